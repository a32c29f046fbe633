"""Per-row token sampling (temperature, top-p, top-k) with the log-probs SGLang reports.

Every setting is a traced per-row array, so one compiled step serves any mix of requests.

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


def sample_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, *, original: bool = False) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row of logits [B, V]; temperature, top_p, top_k are [B] arrays.

    Returns (token ids [B] int32, log-probs [B] float32) as described in the module docstring.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (ranks < k) & (mass_before < top_p[:, None])
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    tokens = jnp.where(greedy, order[:, 0], sampled).astype(jnp.int32)
    reference = logits if original else scaled
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(reference, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
