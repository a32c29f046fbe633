"""Chunked token log-probabilities (and entropies) from final hidden states.

With Qwen3's 151,936-token vocabulary an 8K-token sequence has 5 GiB of fp32 logits per row, and
autodiff of a naive log-softmax keeps several such buffers alive for the backward pass. Here the
sequence is cut into chunks and a `lax.scan` computes one chunk's logits at a time. The gradient is
written by hand (`jax.custom_vjp`): the forward pass keeps only each token's log-normaliser (and
entropy), and the backward pass recomputes one chunk's logits, turns them into that chunk's logit
gradient in one elementwise pass, and accumulates the unembedding's gradient in fp32 across chunks.
So at most a chunk's [B, C, V] logits and their gradient exist at a time, and nothing of the
logits' size is kept between the two passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _chunk_logits(hidden, unembedding, temperature):
    return jnp.einsum("bcd,dv->bcv", hidden, unembedding.astype(hidden.dtype),
                      preferred_element_type=jnp.float32) / temperature


def _chunk_stats(hidden, unembedding, targets, temperature, with_entropy: bool):
    """(logprobs, log-normaliser, entropy or zeros) of one chunk, all [B, C] fp32."""
    logits = _chunk_logits(hidden, unembedding, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logprobs = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return logprobs, lse, jnp.zeros_like(lse)
    probs = jnp.exp(logits - lse[..., None])
    return logprobs, lse, lse - jnp.sum(probs * logits, axis=-1)


def _scan_stats(hidden_chunks, unembedding, target_chunks, temperature, with_entropy):
    def body(_, xs):
        h, targets = xs
        return None, _chunk_stats(h, unembedding, targets, temperature, with_entropy)

    _, stats = jax.lax.scan(body, None, (hidden_chunks, target_chunks))
    return stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_head(hidden_chunks, unembedding, target_chunks, temperature, with_entropy):
    logprobs, _, entropy = _scan_stats(hidden_chunks, unembedding, target_chunks, temperature, with_entropy)
    return logprobs, entropy


def _chunked_head_fwd(hidden_chunks, unembedding, target_chunks, temperature, with_entropy):
    logprobs, lse, entropy = _scan_stats(hidden_chunks, unembedding, target_chunks, temperature, with_entropy)
    return (logprobs, entropy), (hidden_chunks, unembedding, target_chunks, temperature, lse, entropy)


def _explicit_sharding(x):
    """`x`'s sharding when its mesh has Explicit axes (sharding in types, `jax.make_mesh`'s default),
    else None. Under Explicit axes an einsum that contracts a sharded dimension (the batch, in the
    unembedding's gradient) must be told how to shard its output: as the array it is the gradient of."""
    sharding = jax.typeof(x).sharding
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return sharding if any(t == jax.sharding.AxisType.Explicit for t in axis_types) else None


def _chunked_head_bwd(with_entropy, residuals, cotangents):
    hidden_chunks, unembedding, target_chunks, temperature, lse_chunks, entropy_chunks = residuals
    g_logprobs, g_entropy = cotangents
    compute = unembedding.astype(hidden_chunks.dtype)
    unembedding_sharding = _explicit_sharding(unembedding)

    def body(g_unembedding, xs):
        h, targets, lse, entropy, g_lp, g_ent = xs
        z = _chunk_logits(h, compute, temperature)  # z = logits / T, [B, C, V]
        log_p = z - lse[..., None]
        p = jnp.exp(log_p)
        hit = jnp.arange(z.shape[-1], dtype=targets.dtype) == targets[..., None]
        # d logprob / dz = onehot - p;  d entropy / dz = -p (log p + H); both scaled by 1/T for d/d logits.
        g_z = g_lp[..., None] * (hit - p)
        if with_entropy:
            g_z = g_z - g_ent[..., None] * p * (log_p + entropy[..., None])
        g_logits = (g_z / temperature).astype(h.dtype)
        g_h = jnp.einsum("bcv,dv->bcd", g_logits, compute, preferred_element_type=jnp.float32,
                         out_sharding=_explicit_sharding(h)).astype(h.dtype)
        g_unembedding = g_unembedding + jnp.einsum("bcd,bcv->dv", h, g_logits, preferred_element_type=jnp.float32,
                                                   out_sharding=unembedding_sharding)
        return g_unembedding, g_h

    g_unembedding, g_hidden = jax.lax.scan(
        body, jnp.zeros_like(unembedding, jnp.float32),
        (hidden_chunks, target_chunks, lse_chunks, entropy_chunks, g_logprobs, g_entropy))
    return g_hidden, g_unembedding.astype(unembedding.dtype), None, jnp.zeros_like(temperature)


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy"))
def token_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *, chunk_size: int = 1024,
                   temperature: float | jax.Array = 1.0, return_entropy: bool = False):
    """log p(targets | hidden) per token, computed chunk by chunk along the sequence.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm).
      unembedding: [D, V] output projection.
      targets: [B, T] int token ids to score.
      chunk_size: sequence chunk length (static); T need not be a multiple of it.
      temperature: logits are divided by it (traced: changing it does not recompile; no gradient).
      return_entropy: also return the entropy of each position's distribution.

    Returns:
      logprobs [B, T] float32, or (logprobs, entropy) when return_entropy.
    """
    b, t, d = hidden.shape
    if targets.shape != (b, t):
        raise ValueError(f"token_logprobs: targets shape {targets.shape} != hidden's [B, T] {(b, t)}")
    if unembedding.shape[0] != d:
        raise ValueError(f"token_logprobs: unembedding shape {unembedding.shape} does not match hidden size {d}")
    chunk = min(chunk_size, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [n_chunks, B, C, ...]: scan over chunks.
    hidden_chunks = hidden.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
    target_chunks = targets.reshape(b, n_chunks, chunk).swapaxes(0, 1)
    temperature = jnp.asarray(temperature, jnp.float32)
    with jax.named_scope("logprob_head"):
        logprobs, entropy = _chunked_head(hidden_chunks, unembedding, target_chunks, temperature, return_entropy)
    logprobs = logprobs.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    if return_entropy:
        return logprobs, entropy.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    return logprobs


def naive_token_logprobs(hidden, unembedding, targets, temperature=1.0, return_entropy=False):
    """Reference: full [B, T, V] logits (for tests and small models only)."""
    logits = jnp.einsum("btd,dv->btv", hidden, unembedding.astype(hidden.dtype),
                        preferred_element_type=jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if return_entropy:
        return out, -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return out
