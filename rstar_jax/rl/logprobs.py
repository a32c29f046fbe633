"""Chunked token log-probabilities (and entropies) from final hidden states.

With Qwen3's 151,936-token vocabulary an 8K-token sequence has 5 GiB of fp32 logits per row, and
autodiff of a naive log-softmax keeps several such buffers alive for the backward pass. Here the
sequence is cut into chunks and a `lax.scan` computes one chunk's logits at a time. The gradient is
written by hand (`jax.custom_vjp`): the forward pass keeps only each token's log-normaliser (and
entropy), and the backward pass recomputes one chunk's logits, turns them into that chunk's logit
gradient in one elementwise pass, and accumulates the unembedding's gradient in fp32 across chunks.
So at most a chunk's [B, C, V] logits and their gradient exist at a time, and nothing of the
logits' size is kept between the two passes.

It runs on meshes of either axis type (Auto, or Explicit as `jax.make_mesh` makes them), with the
batch sharded over data axes and the unembedding replicated, vocab-sharded or FSDP-sharded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Meshes of either axis type. Under Auto axes XLA's partitioner places what is not constrained;
# under Explicit ones (`jax.make_mesh`'s default since jax 0.10) every array's sharding is in its
# type, and JAX refuses an op whose output sharding it cannot infer. `rstar_jax.rl` imports no other
# layer, so these few lines mirror `rstar_jax.model.sharding`'s helpers.

def _explicit_sharding(x):
    """`x`'s sharding when its mesh has Explicit axes (sharding in types, `jax.make_mesh`'s default),
    else None. Under Explicit axes an einsum that contracts a sharded dimension (the batch, in the
    unembedding's gradient; the vocabulary, in the hidden states') must be told how to shard its
    output: as the array it is the gradient of."""
    sharding = jax.typeof(x).sharding
    return sharding if _explicit_axes(sharding) else None


def _explicit_axes(sharding) -> frozenset:
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", None) or ()
    return frozenset(name for name, t in zip(getattr(mesh, "axis_names", ()), types)
                     if t == jax.sharding.AxisType.Explicit)


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _compute_layouts(hidden, unembedding, targets):
    """Under Explicit axes, reshards the inputs to the layout the head computes in: hidden [B, T, D]
    and targets [B, T] sharded on the batch only, the unembedding [D, V] on the vocabulary only (an
    FSDP-sharded D is gathered, as the model gathers its weights), less any axis the batch already
    uses. Auto axes are left to XLA's partitioner: the inputs come back unchanged."""
    h_type, w_type = jax.typeof(hidden).sharding, jax.typeof(unembedding).sharding
    explicit = _explicit_axes(h_type) | _explicit_axes(w_type)
    if not explicit:
        return hidden, unembedding, targets
    mesh = (h_type if _explicit_axes(h_type) else w_type).mesh
    batch = _entry([a for a in _axes((*h_type.spec, None)[0]) if a in explicit])
    vocab = _entry([a for a in _axes((*w_type.spec, None, None)[1]) if a in explicit and a not in _axes(batch)])

    def to(x, *spec):
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

    return to(hidden, batch, None, None), to(unembedding, None, vocab), to(targets, batch, None)


def _chunk_logits(hidden, unembedding, temperature):
    return jnp.einsum("bcd,dv->bcv", hidden, unembedding.astype(hidden.dtype),
                      preferred_element_type=jnp.float32) / temperature


def _one_hot(logits, targets):
    return jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]


def _chunk_stats(hidden, unembedding, targets, temperature, with_entropy: bool):
    """(logprobs, log-normaliser, entropy or zeros) of one chunk, all [B, C] fp32."""
    logits = _chunk_logits(hidden, unembedding, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit by a masked sum, not a gather: a reduction over the vocabulary stays local
    # to each shard of a vocab-sharded unembedding (a gather there is refused under Explicit axes).
    logprobs = jnp.sum(jnp.where(_one_hot(logits, targets), logits, 0.0), axis=-1) - lse
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
        hit = _one_hot(z, targets)
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
    hidden, unembedding, targets = _compute_layouts(hidden, unembedding, targets)
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
