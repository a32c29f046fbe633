"""Chunked token log-probabilities (and entropies) from final hidden states.

With Qwen3's 151,936-token vocabulary an 8K-token sequence has 5 GiB of fp32 logits per row, and
autodiff of a naive log-softmax keeps several such buffers alive for the backward pass. Here the
sequence is cut into chunks and a rematerialised `lax.scan` computes one chunk's logits at a time in
the forward pass and recomputes them in the backward pass, so at most a chunk's [B, C, V] logits
ever exist.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _chunk_stats(hidden, unembedding, targets, temperature, with_entropy: bool):
    logits = jnp.einsum("bcd,dv->bcv", hidden, unembedding.astype(hidden.dtype),
                        preferred_element_type=jnp.float32) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprobs = target_logits - lse
    if not with_entropy:
        return logprobs, jnp.zeros_like(logprobs)
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logprobs, entropy


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy"))
def token_logprobs(hidden: jax.Array, unembedding: jax.Array, targets: jax.Array, *, chunk_size: int = 1024,
                   temperature: float | jax.Array = 1.0, return_entropy: bool = False):
    """log p(targets | hidden) per token, computed chunk by chunk along the sequence.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm).
      unembedding: [D, V] output projection.
      targets: [B, T] int token ids to score.
      chunk_size: sequence chunk length (static); T need not be a multiple of it.
      temperature: logits are divided by it (traced: changing it does not recompile).
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

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(_, xs):
        h, tg = xs
        return None, _chunk_stats(h, unembedding, tg, temperature, return_entropy)

    _, (logprobs, entropy) = jax.lax.scan(body, None, (hidden_chunks, target_chunks))
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
