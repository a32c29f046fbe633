"""Per-row token sampling (temperature, top-p, top-k) with the log-probs SGLang reports.

Every setting is a traced per-row array, so one compiled step serves any mix of requests. A row
that truncates nothing (top_p 1, top_k off) draws straight from its scaled logits; the vocabulary
sort that top-p / top-k need runs only when some row in the batch truncates, and a row's draw does
not depend on which path its batch took.

Semantics follow SGLang's sampler:
- temperature in [0, 1e-6) or top_k == 1 is greedy (argmax of the raw logits);
- top-k keeps the k most likely tokens (top_k <= 0: the whole vocabulary);
- top-p keeps the smallest prefix of the sorted distribution (after temperature) whose mass reaches
  top_p: a token stays while the mass strictly before it is below top_p, so the first always stays.

Returned log-probs (SGLang's `output_token_logprobs`): by default log-softmax of the
temperature-scaled logits (logits / T; T = 1 for greedy rows) at the sampled token, before top-p /
top-k truncation, which is what SGLang returns by default. With `original=True` it is log-softmax
of the raw logits, SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB=1`. At temperature 1 (the RL setting)
the two coincide and equal what the trainer recomputes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY_TEMPERATURE = 1e-6


def row_keys(step_key: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-row sampling keys [B]: seeded rows (seeds >= 0) draw from key(seed) folded with the
    token's absolute position, so a seeded request samples the same tokens whatever it is batched
    with and across engine restarts; unseeded rows (seeds < 0) split the engine's key stream."""
    def one(row, seed, position):
        seeded = jax.random.fold_in(jax.random.key(jnp.maximum(seed, 0)), position)
        return jax.lax.cond(seed >= 0, lambda: seeded, lambda: jax.random.fold_in(step_key, row))

    rows = jnp.arange(seeds.shape[0], dtype=jnp.int32)
    return jax.vmap(one)(rows, seeds, positions)


def greedy_rows(temperature, top_k):
    """Rows that take the argmax (NumPy or JAX arrays alike)."""
    return (temperature < GREEDY_TEMPERATURE) | (top_k == 1)


def truncating_rows(temperature, top_p, top_k, vocab: int):
    """Rows that sample from a top-p / top-k truncation of the vocabulary (NumPy or JAX arrays
    alike: the engine's host decides `sample_tokens`'s `truncation` with the same rule)."""
    return ~greedy_rows(temperature, top_k) & ((top_p < 1.0) | ((top_k > 0) & (top_k < vocab)))


def sample_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, *, original: bool = False,
                  truncation: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row of logits [B, V]; temperature, top_p, top_k are [B] arrays.

    key: one key for the whole batch, or a [B] array of keys (one per row: a row's draw then depends
    only on its own key, not on which other requests share the batch).
    truncation: whether some row truncates (top-p / top-k), when the caller knows (`truncates` below,
    from the host's settings). None decides on the device with a conditional, which on a GPU reads
    the predicate back to the host: the host then waits for everything before it, so a caller that
    overlaps its steps passes the answer instead. False with a row that truncates samples it wrongly.
    Returns (token ids [B] int32, log-probs [B] float32) as described in the module docstring.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = greedy_rows(temperature, top_k)
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    truncates = truncating_rows(temperature, top_p, top_k, vocab)

    def categorical(keys, rows):
        if keys.ndim == 1:
            return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, rows)
        return jax.random.categorical(keys, rows, axis=-1)

    def truncated_draws(_):
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        ranks = jnp.arange(vocab)[None, :]
        k = jnp.where(top_k > 0, top_k, vocab)[:, None]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = (ranks < k) & (mass_before < top_p[:, None])
        masked = jnp.where(keep, sorted_logits, -jnp.inf)
        return jnp.take_along_axis(order, categorical(key, masked)[:, None], axis=-1)[:, 0]

    # The O(V log V) sort only runs when a row needs it (top-p / top-k); at the RL setting (top_p 1,
    # top_k off) every row samples its scaled logits directly.
    direct = categorical(key, scaled)
    if truncation is None:
        sampled = jax.lax.cond(truncates.any(), truncated_draws, lambda _: direct, None)
    else:
        sampled = truncated_draws(None) if truncation else direct
    sampled = jnp.where(truncates, sampled, direct)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    reference = logits if original else scaled
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(reference, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
