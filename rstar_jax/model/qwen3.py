"""Qwen3 dense decoder in Flax NNX.

Layer parameters are stacked along a leading ``layers`` axis and the decoder runs as one
``jax.lax.scan``: a 40-layer 14B model compiles as fast as a 2-layer one, and per-layer remat is a
policy on the scanned body. The forwards also take the layers' parameters as a sequence of per-layer
arrays (`hidden_states(..., layers=)`, `forward_with_paged_cache(..., layers=)`; `unstack_layers`
makes them), run as a Python loop unrolled into the program: no layer's weights are sliced out of a
stacked array, which on GPU is a copy per weight per layer (the engine's "per_layer" layout).

Every parameter carries logical axis names (metadata ``logical_axes``) that `rstar_jax.model.sharding`
maps to mesh axes through a rules table. The full forward and its gradient run on meshes of either
axis type: under Explicit axes (`jax.make_mesh`'s default) each layer's weights are gathered over
the batch's axes and contractions over sharded dimensions name their output's sharding; under Auto
axes (`rstar_jax.parallel.make_mesh`) XLA places both.

Numerics follow Hugging Face ``Qwen3ForCausalLM``: RMSNorm in fp32 with weight applied after the
cast back, per-head q/k RMSNorm before RoPE, half-split ("rotate_half") RoPE, grouped-query
attention, SwiGLU MLP, no biases.

`Qwen3Config` and the dtype / remat / attention names live in `rstar_jax.model.config` (no jax, so
configs are checked without it) and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from rstar_jax.model.config import (
    ATTENTION_IMPLS,
    DTYPE_NAMES,
    REMAT_POLICY_NAMES,
    Qwen3Config,
    dtype_name,
)
from rstar_jax.model.paged_attention import paged_decode_attention
from rstar_jax.model.sharding import batch_axes, constrain, gather_axes, spec_axes, spec_entry, type_sharding

# Single-token (decode) attention over the paged pool: `forward_with_paged_cache(decode_attention=)`.
DECODE_ATTENTIONS = ("xla", "pallas")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# The decoder layer's activations tagged with `checkpoint_name`, which the "save_*" / "offload_*"
# policies keep. The matmuls' outputs, not what the elementwise ops after them make: the backward
# then recomputes only norms, RoPE and SiLU from them (o_proj's output: the residual the
# post-attention norm reads).
REMAT_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlp_gate", "mlp_up")
_QKV_ATTENTION = ("query_proj", "key_proj", "value_proj", "attention_out")
# The names each offloading policy moves to pinned host memory (the rest of REMAT_NAMES stay on the device).
REMAT_OFFLOADED = {"offload_mlp": ("out_proj", "mlp_gate", "mlp_up"), "offload_named": REMAT_NAMES}


def _offload(name: str):
    saved = tuple(n for n in REMAT_NAMES if n not in REMAT_OFFLOADED[name])
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=REMAT_OFFLOADED[name],
        offload_src="device", offload_dst="pinned_host")


# The jax.checkpoint policy of each remat policy name (`rstar_jax.model.config` describes them).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
    "save_qkv_attention": jax.checkpoint_policies.save_only_these_names(*_QKV_ATTENTION),
    "save_named": jax.checkpoint_policies.save_only_these_names(*REMAT_NAMES),
    "offload_mlp": _offload("offload_mlp"),
    "offload_named": _offload("offload_named"),
}


def check_remat_backend(policy: str) -> None:
    """Refuses an offloading remat policy where the default backend's devices have no pinned host
    memory to offload to (XLA would fail at compile time with a less telling message)."""
    if policy not in REMAT_OFFLOADED:
        return
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(f"Qwen3Config.remat_policy={policy!r} offloads to pinned host memory, which "
                         f"{device.platform} devices lack (memory kinds: {sorted(kinds)}); use a 'save_*' policy")
# The config checks names against the jax-free lists: a name there must have its dtype and policy here.
if tuple(sorted(_DTYPES)) != DTYPE_NAMES or tuple(REMAT_POLICIES) != REMAT_POLICY_NAMES:
    raise ImportError("rstar_jax.model.qwen3: _DTYPES / REMAT_POLICIES disagree with "
                      "DTYPE_NAMES / REMAT_POLICY_NAMES in rstar_jax.model.config")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """A pool of fixed-size KV pages shared by all sequences: [layers, pages, page_size, kv_heads, head_dim],
    or with `heads_first` [kv_heads, layers, pages, page_size, head_dim], the layout the Pallas
    paged-attention kernel reads (`rstar_jax.model.paged_attention`).

    A page table [batch, pages_per_sequence] maps row b's position p to page `table[b, p // page_size]`
    at offset `p % page_size`. Entries >= `num_pages` mark pages not allocated: writes there are
    dropped and reads are masked, so a sequence only holds the pages its length needs.
    """

    k: jax.Array
    v: jax.Array
    heads_first: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_pages(self) -> int:
        return self.k.shape[2 if self.heads_first else 1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3 if self.heads_first else 2]


# ---------------------------------------------------------------------------------------------
# Pure building blocks (shared by the full forward and the paged-cache forward).
# ---------------------------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Half-split rotary embedding of x [B, T, heads, head_dim] at integer positions [B, T]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def xla_attention(q, k, v, mask):
    """Grouped-query attention without repeating K/V: q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [B,T,S]."""
    b, t, h, hd = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / np.sqrt(hd)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, hd)


def single_query_attention(q, k, v, mask):
    """xla_attention for one query per row (decode), as multiply-reduce: q [B,1,H,hd], k/v [B,S,Hkv,hd].

    A batched dot over (B, Hkv) wants K and V laid out [B, Hkv, S, hd], so XLA transposes the whole
    gathered span twice per layer; at one query per row the work is a memory-bound reduction, which
    reads K and V once where they lie.
    """
    b, t, h, hd = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, kv_heads, h // kv_heads, hd).astype(jnp.float32)
    scores = jnp.sum(q[:, None] * k[:, :, :, None, :].astype(jnp.float32), axis=-1) / np.sqrt(hd)  # [B,S,Hkv,G]
    scores = jnp.where(mask[:, 0, :, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)  # [B,Hkv,G,hd]
    return out.astype(v.dtype).reshape(b, t, h, hd)


# Query rows per block of `blockwise_attention`: its temporaries are [B, heads, block, S] fp32 scores.
BLOCKWISE_QUERY_BLOCK = 256


def blockwise_attention(q, k, v, positions, segment_ids, block: int = BLOCKWISE_QUERY_BLOCK):
    """xla_attention's result (mask: positions q >= k within a segment) computed over query blocks,
    with a hand-written backward that recomputes each block's probabilities from the saved
    log-sum-exp: what it holds for the backward is q, k, v, the output and [B, heads, T] statistics,
    as a fused attention kernel (cuDNN's) holds, never a [T, S] score matrix. Runs on any backend:
    long rows on CPU, and the compiled memory of the cuDNN path estimated where cuDNN is absent."""
    b, t = q.shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    pad = -t % min(block, t)
    if pad:  # padded query rows see no key (segment -1) and are dropped
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        q_pos = jnp.pad(positions, ((0, 0), (0, pad)))
        q_seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    else:
        q_pos, q_seg = positions, segment_ids
    out = _blockwise(q, k, v, (q_pos, q_seg, positions, segment_ids), min(block, t))
    return out[:, :t]


def _to_blocks(x, block):  # [B, T, ...] -> [T / block, B, block, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def _from_blocks(x):  # [T / block, B, block, ...] -> [B, T, ...]
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _block_scores(qb, k, q_pos, q_seg, k_pos, k_seg):
    """Masked scores [B, Hkv, G, block, S] (fp32) of a query block qb [B, block, Hkv, G, hd], and the mask."""
    scores = jnp.einsum("btkgd,bskd->bkgts", qb, k, preferred_element_type=jnp.float32) / np.sqrt(qb.shape[-1])
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    return jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min), mask[:, None, None]


def _grouped(x, kv_heads):  # [B, T, H, hd] -> [B, T, Hkv, H / Hkv, hd]
    return x.reshape(x.shape[0], x.shape[1], kv_heads, x.shape[2] // kv_heads, x.shape[3])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q, k, v, masks, block):
    return _blockwise_fwd(q, k, v, masks, block)[0]


def _blockwise_fwd(q, k, v, masks, block):
    q_pos, q_seg, k_pos, k_seg = masks

    def one(xs):
        qb, pb, sb = xs
        scores, _ = _block_scores(qb, k, pb, sb, k_pos, k_seg)
        lse = jax.nn.logsumexp(scores, axis=-1)
        probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", probs, v), lse

    out, lse = jax.lax.map(one, (_to_blocks(_grouped(q, k.shape[2]), block), _to_blocks(q_pos, block),
                                 _to_blocks(q_seg, block)))
    out = _from_blocks(out).reshape(q.shape)
    return out, (q, k, v, masks, out, lse)


def _blockwise_bwd(block, residuals, d_out):
    q, k, v, masks, out, lse = residuals
    q_pos, q_seg, k_pos, k_seg = masks
    kv_heads, f32 = k.shape[2], jnp.float32
    # softmax's backward: dS = P * (dP - rowsum(dO * O))
    delta = jnp.sum(_grouped(d_out, kv_heads).astype(f32) * _grouped(out, kv_heads).astype(f32), axis=-1)

    def one(carry, xs):
        dk, dv = carry
        qb, pb, sb, dob, lseb, deltab = xs
        scores, mask = _block_scores(qb, k, pb, sb, k_pos, k_seg)
        probs = jnp.exp(scores - lseb[..., None])
        dv = dv + jnp.einsum("bkgts,btkgd->bskd", probs.astype(v.dtype), dob, preferred_element_type=f32)
        dp = jnp.einsum("btkgd,bskd->bkgts", dob, v, preferred_element_type=f32)
        ds = jnp.where(mask, probs * (dp - jnp.moveaxis(deltab, 1, -1)[..., None]), 0.0) / np.sqrt(q.shape[-1])
        ds = ds.astype(q.dtype)
        dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds, qb, preferred_element_type=f32)
        return (dk, dv), jnp.einsum("bkgts,bskd->btkgd", ds, k, preferred_element_type=f32).astype(q.dtype)

    xs = (_to_blocks(_grouped(q, kv_heads), block), _to_blocks(q_pos, block), _to_blocks(q_seg, block),
          _to_blocks(_grouped(d_out, kv_heads), block), lse, _to_blocks(delta, block))
    (dk, dv), dq = jax.lax.scan(one, (jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)), xs)
    return _from_blocks(dq).reshape(q.shape), dk.astype(k.dtype), dv.astype(v.dtype), None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def cudnn_attention(q, k, v, segment_ids):
    """cuDNN fused attention through the public API; the score matrix is never materialised.

    Rows holding one sequence (segment ids 1...1 0...0, the padded layout) use causal masking plus
    per-row lengths. Packed rows need a segment mask, which the public API only takes as an explicit
    [B, 1, T, T] boolean mask: still no score matrix, but quadratic in bytes.
    """
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    lengths = jnp.sum(segment_ids > 0, axis=-1).astype(jnp.int32)
    packed = jnp.max(segment_ids, axis=-1) > 1
    single = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation="cudnn")

    def with_mask():
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        t = segment_ids.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        return jax.nn.dot_product_attention(q, k, v, mask=(same & causal)[:, None], implementation="cudnn")

    return jax.lax.cond(jnp.any(packed), with_mask, lambda: single)


class Qwen3(nnx.Module):
    """Qwen3 causal LM. ``model(ids, positions, segment_ids) -> logits [B, T, V]`` (fp32)."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        pdt = _DTYPES[c.param_dtype]
        L, D, F, H, K, HD, V = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
                                c.num_kv_heads, c.head_dim, c.vocab_size)
        normal = jax.nn.initializers.normal(0.02)

        def param(shape, axes, init=normal):
            return nnx.Param(init(rngs.params(), shape, pdt), logical_axes=axes)

        ones = lambda key, shape, dtype: jnp.ones(shape, dtype)  # noqa: E731
        self.embed = param((V, D), ("vocab", "embed"))
        self.input_norm = param((L, D), ("layers", "norm"), ones)
        self.q_proj = param((L, D, H, HD), ("layers", "embed", "heads", "head_dim"))
        self.k_proj = param((L, D, K, HD), ("layers", "embed", "kv_heads", "head_dim"))
        self.v_proj = param((L, D, K, HD), ("layers", "embed", "kv_heads", "head_dim"))
        self.o_proj = param((L, H, HD, D), ("layers", "heads", "head_dim", "embed"))
        self.q_norm = param((L, HD), ("layers", "norm"), ones)
        self.k_norm = param((L, HD), ("layers", "norm"), ones)
        self.post_attn_norm = param((L, D), ("layers", "norm"), ones)
        self.gate_proj = param((L, D, F), ("layers", "embed", "mlp"))
        self.up_proj = param((L, D, F), ("layers", "embed", "mlp"))
        self.down_proj = param((L, F, D), ("layers", "mlp", "embed"))
        self.final_norm = param((D,), ("norm",), ones)
        if not c.tie_word_embeddings:
            self.lm_head = param((D, V), ("embed", "vocab"))
        # Optional activation sharding constraints as hashable ((kind, sharding), ...) pairs, set by
        # rstar_jax.model.sharding.set_activation_shardings; static graph metadata, not state.
        self.activation_shardings: tuple[tuple[str, Any], ...] = ()

    LAYER_PARAMS = ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                    "post_attn_norm", "gate_proj", "up_proj", "down_proj")

    # -- helpers --------------------------------------------------------------------------------
    def _layer_params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.LAYER_PARAMS}

    def _run_layers(self, layer, carry, layers: Sequence[dict[str, jax.Array]] | None, *, index: bool = False):
        """`layer(carry, xs) -> (carry, None)` over the decoder's layers: a scan over the stacked
        parameters when `layers` is None, else a Python loop over the given per-layer parameters
        (each layer's weights their own arrays: nothing is sliced). With `index`, xs is
        (parameters, layer index): a traced int32 under the scan, a Python int in the loop."""
        if layers is None:
            params = self._layer_params()
            xs = (params, jnp.arange(self.config.num_layers, dtype=jnp.int32)) if index else params
            return jax.lax.scan(layer, carry, xs)[0]
        if len(layers) != self.config.num_layers:
            raise ValueError(f"Qwen3: layers holds {len(layers)} layers' parameters, the model has "
                             f"{self.config.num_layers}")
        for i, p in enumerate(layers):
            carry, _ = layer(carry, (p, i) if index else p)
        return carry

    def _activation_sharding(self, kind: str, shape, batch: tuple[str, ...] = ()):
        """The NamedSharding of activation `kind` (None when unset). `batch`: the mesh axes that
        already shard the batch in its type (Explicit axes): the caller's layout is kept there, so
        that the outputs meet the caller's other arrays (masks, old log-probs) as they are laid out."""
        for name, sharding in self.activation_shardings:
            if name == kind:
                entries = tuple(sharding.spec) + (None,) * len(shape)
                if batch:
                    entries = (batch,) + tuple(
                        spec_entry([a for a in spec_axes(e) if a not in batch]) for e in entries[1:])
                # Leave a dimension unconstrained when its size does not divide over its mesh axes
                # (e.g. a batch of 4 on an 8-way fsdp axis) rather than failing to compile.
                spec = []
                for size, axes in zip(shape, entries):
                    ways = int(np.prod([sharding.mesh.shape[a] for a in spec_axes(axes)]))
                    spec.append(spec_entry(spec_axes(axes)) if size % ways == 0 else None)
                return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
        return None

    def _constrain(self, x: jax.Array, kind: str) -> jax.Array:
        sharding = self._activation_sharding(kind, x.shape, batch_axes(type_sharding(x)))
        return x if sharding is None else constrain(x, sharding)

    @staticmethod
    def _gathered(p: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
        """Under Explicit axes, the weights gathered over the axes that shard x's batch (FSDP's
        all-gather, one layer at a time inside the scan): a mesh axis cannot shard both an
        activation's batch and the weight it meets. Under Auto axes XLA's partitioner does this."""
        axes = batch_axes(type_sharding(x))
        return {name: gather_axes(w, axes) for name, w in p.items()}

    def unembedding(self) -> jax.Array:
        """[D, V] output projection (the transposed embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    @jax.named_scope("embed")
    def _embed(self, input_ids):
        dt = _DTYPES[self.config.dtype]
        table = self.embed[...]
        sharding = type_sharding(table) or type_sharding(input_ids)
        if sharding is None:
            h = jnp.take(table, input_ids, axis=0)
        else:
            # Under Explicit axes a gather must be told its output's sharding (JAX infers none when
            # the table or the ids are sharded): the residual stream's, keeping the ids' batch layout.
            batch = batch_axes(type_sharding(input_ids))
            out = self._activation_sharding("act_btd", (*input_ids.shape, table.shape[1]), batch)
            if out is None:
                out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec_entry(batch)))
            table = gather_axes(table, batch_axes(out))
            h = table.at[input_ids].get(mode="fill", out_sharding=out)
        return self._constrain(h.astype(dt), "act_btd")

    @jax.named_scope("qkv")
    def _qkv(self, p, x, positions):
        c = self.config
        dt = x.dtype
        q = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, p["q_proj"].astype(dt)), "query_proj")
        k = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, p["k_proj"].astype(dt)), "key_proj")
        v = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, p["v_proj"].astype(dt)), "value_proj")
        q = rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), positions, c.rope_theta)
        k = rope(rms_norm(k, p["k_norm"], c.rms_norm_eps), positions, c.rope_theta)
        return self._constrain(q, "act_bthd"), k, v

    def _finish_layer(self, p, h, attn):
        c = self.config
        dt = h.dtype
        with jax.named_scope("o_proj"):
            # Contracts the tensor-sharded heads: under Explicit axes the sum lands as the residual's.
            out = jnp.einsum("bthk,hkd->btd", attn, p["o_proj"].astype(dt), out_sharding=type_sharding(h))
            h = self._constrain(h + checkpoint_name(out, "out_proj"), "act_btd")
        with jax.named_scope("mlp"):
            x = rms_norm(h, p["post_attn_norm"], c.rms_norm_eps)
            gate = checkpoint_name(jnp.einsum("btd,df->btf", x, p["gate_proj"].astype(dt)), "mlp_gate")
            up = checkpoint_name(jnp.einsum("btd,df->btf", x, p["up_proj"].astype(dt)), "mlp_up")
            mlp = jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["down_proj"].astype(dt),
                             out_sharding=type_sharding(h))
            return self._constrain(h + mlp, "act_btd")

    # -- full forward ---------------------------------------------------------------------------
    def hidden_states(self, input_ids, positions=None, segment_ids=None, *,
                      layers: Sequence[dict[str, jax.Array]] | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, D] in the compute dtype. `layers`: the decoder layers'
        parameters as per-layer arrays (`unstack_layers`), used instead of the stacked ones."""
        c = self.config
        check_remat_backend(c.remat_policy)
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h = self._embed(input_ids)
        if c.attention_impl == "xla":
            mask = positions[:, :, None] >= positions[:, None, :]
            if segment_ids is not None:
                mask &= segment_ids[:, :, None] == segment_ids[:, None, :]

        @jax.named_scope("decoder_layer")
        def layer(h, p):
            p = self._gathered(p, h)
            x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
            q, k, v = self._qkv(p, x, positions)
            with jax.named_scope("attention"):
                if c.attention_impl == "xla":
                    attn = xla_attention(q, k, v, mask)
                elif c.attention_impl == "blockwise":
                    attn = blockwise_attention(q, k, v, positions, segment_ids)
                else:
                    attn = cudnn_attention(q, k, v, segment_ids)
            return self._finish_layer(p, h, checkpoint_name(attn, "attention_out")), None

        policy = REMAT_POLICIES[c.remat_policy]
        if c.remat_policy != "none":
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        h = self._run_layers(layer, h, layers)
        with jax.named_scope("final_norm"):
            return rms_norm(h, self.final_norm[...], c.rms_norm_eps)

    @jax.named_scope("unembed")
    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        w = gather_axes(self.unembedding(), batch_axes(type_sharding(hidden)))
        return jnp.einsum("btd,dv->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def __call__(self, input_ids, positions=None, segment_ids=None) -> jax.Array:
        return self.logits_from_hidden(self.hidden_states(input_ids, positions, segment_ids))

    # -- paged KV-cache forward (prefill and decode) -------------------------------------------
    def init_paged_cache(self, num_pages: int, page_size: int, dtype: DTypeLike | None = None, *,
                         heads_first: bool = False) -> PagedKVCache:
        """A zeroed page pool; `dtype` (a name or JAX/NumPy dtype) defaults to the compute dtype.
        `heads_first`: the Pallas decode kernel's layout (see PagedKVCache)."""
        c = self.config
        dtype = _DTYPES[dtype_name(c.dtype if dtype is None else dtype, "init_paged_cache.dtype")]
        if heads_first:
            shape = (c.num_kv_heads, c.num_layers, num_pages, page_size, c.head_dim)
        else:
            shape = (c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), heads_first=heads_first)

    def forward_with_paged_cache(self, input_ids, positions, cache: PagedKVCache, page_table: jax.Array,
                                 logits_at: jax.Array | None = None, *,
                                 layers: Sequence[dict[str, jax.Array]] | None = None,
                                 decode_attention: str = "xla", mesh: jax.sharding.Mesh | None = None
                                 ) -> tuple[jax.Array, PagedKVCache]:
        """Writes the new tokens' K/V at their absolute positions and attends to positions <= each
        token's own, over a shared page pool; page_table [B, pages_per_sequence] (see PagedKVCache).

        input_ids, positions: [B, T]. Positions may differ per row (continuous batching). Each row reads
        its pages back in order (a gather of pages_per_sequence * page_size positions), so the attention
        is the dense one over that row's span. Positions whose page is not allocated, or beyond the
        span, write nothing (their outputs are meaningless). `logits_at` [B]: unembed only that
        position of each row and return logits [B, 1, V], as a prefill needs. `layers`: the decoder
        layers' parameters as per-layer arrays (`unstack_layers`), run unrolled instead of the scan
        over the stacked ones; the pools stay stacked, each layer writing and reading its own slice
        of them in place.

        `decode_attention`: "xla" (the gathered pages' multiply-reduce) or "pallas" (the Pallas GPU
        kernel over the pages where they lie, `rstar_jax.model.paged_attention`; it needs a
        heads-first cache) for single-token steps; longer steps always take the XLA path. `mesh`:
        the cache's, for the kernel's split over the "tensor" axis.
        """
        c = self.config
        if decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got {decode_attention!r}")
        if decode_attention == "pallas" and not cache.heads_first:
            raise ValueError("decode_attention 'pallas' reads a heads-first KV pool (init_paged_cache(..., "
                             "heads_first=True)); this one is [layers, pages, page_size, kv_heads, head_dim]")
        kernel = decode_attention == "pallas" and input_ids.shape[1] == 1
        heads_first = cache.heads_first
        b, pages_per_sequence = page_table.shape
        page_size = cache.page_size
        span = pages_per_sequence * page_size
        page_index = jnp.minimum(positions // page_size, pages_per_sequence - 1)
        write_page = jnp.take_along_axis(page_table, page_index, axis=1)
        write_page = jnp.where((positions >= 0) & (positions < span), write_page, cache.num_pages)
        offset = positions % page_size
        h = self._embed(input_ids)
        mask = jnp.arange(span)[None, None, :] <= positions[:, :, None]  # [B, T, span]

        @jax.named_scope("decoder_layer")
        def layer(carry, xs):
            # The pools ride in the scan's carry and are updated where they lie: slicing them per
            # layer (scan xs/ys) would copy the whole cache every step.
            h, k_pool, v_pool = carry
            p, index = xs
            p = self._gathered(p, h)
            x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
            q, k, v = self._qkv(p, x, positions)
            with jax.named_scope("kv_write"):
                if heads_first:  # [Hkv, B, T, hd] at [:, layer, page, offset]: only the new tokens move
                    k_new, v_new = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))
                    k_pool = k_pool.at[:, index, write_page, offset].set(k_new.astype(k_pool.dtype), mode="drop")
                    v_pool = v_pool.at[:, index, write_page, offset].set(v_new.astype(v_pool.dtype), mode="drop")
                else:
                    k_pool = k_pool.at[index, write_page, offset].set(k.astype(k_pool.dtype), mode="drop")
                    v_pool = v_pool.at[index, write_page, offset].set(v.astype(v_pool.dtype), mode="drop")
            if kernel:
                with jax.named_scope("attention"):
                    # Rows past the span (idle slots) attend to nothing: the kernel skips their pages.
                    lengths = jnp.where(positions[:, 0] < span, positions[:, 0] + 1, 0)
                    attn = paged_decode_attention(q[:, 0], k_pool, v_pool, index, page_table, lengths,
                                                  mesh=mesh)[:, None]
                return (self._finish_layer(p, h, attn), k_pool, v_pool), None
            with jax.named_scope("kv_gather"):
                # Unallocated entries are clipped onto a real page; the mask hides what they read.
                if heads_first:  # [Hkv, B, pages, page_size, hd] -> [B, span, Hkv, hd] (prefill's path)
                    k_seq, v_seq = (jnp.transpose(pool.at[:, index, page_table].get(mode="clip"), (1, 2, 3, 0, 4))
                                    .reshape(b, span, pool.shape[0], pool.shape[-1]) for pool in (k_pool, v_pool))
                else:
                    k_seq = k_pool.at[index, page_table].get(mode="clip").reshape(b, span, *k_pool.shape[3:])
                    v_seq = v_pool.at[index, page_table].get(mode="clip").reshape(b, span, *v_pool.shape[3:])
            with jax.named_scope("attention"):
                attend = single_query_attention if input_ids.shape[1] == 1 else xla_attention
                attn = attend(q, k_seq.astype(q.dtype), v_seq.astype(q.dtype), mask)
            return (self._finish_layer(p, h, attn), k_pool, v_pool), None

        h, k_pool, v_pool = self._run_layers(layer, (h, cache.k, cache.v), layers, index=True)
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)
        h = rms_norm(h, self.final_norm[...], c.rms_norm_eps)
        return self.logits_from_hidden(h), PagedKVCache(k=k_pool, v=v_pool, heads_first=heads_first)


def param_logical_axes(model: Qwen3) -> dict[str, tuple[str, ...]]:
    """Logical axis names of every parameter, by attribute name."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[".".join(str(p) for p in path)] = tuple(var.get_metadata()["logical_axes"])
    return out


def unstack_layers(params: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """The stacked layer parameters {name: [layers, ...]} (`Qwen3.LAYER_PARAMS`) as one dict of
    arrays per layer, what the forwards' `layers=` takes. Under jit each is a copy: make them once
    (per weight update), not per step."""
    num_layers = {w.shape[0] for w in params.values()}
    if len(num_layers) != 1:
        raise ValueError(f"unstack_layers: the parameters disagree on the number of layers: {sorted(num_layers)}")
    return tuple({name: w[i] for name, w in params.items()} for i in range(num_layers.pop()))


@functools.lru_cache(maxsize=None)
def _abstract(config: Qwen3Config):
    return nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))


def abstract_model(config: Qwen3Config) -> Qwen3:
    """Shape-only model (no memory): for shardings, memory plans and loaders. Tracing the model is
    cached per config, but every call returns new Variables: a loader fills them in place, and two
    loaded models must never share parameters."""
    graphdef, state = _abstract(config)
    return nnx.merge(graphdef, state, copy=True)


def sequence_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions restarting at 0 at every segment of packed rows [B, T] (padding gets 0)."""
    seg = jnp.asarray(segment_ids)
    idx = jnp.arange(seg.shape[-1])
    starts = jnp.concatenate([jnp.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]], axis=-1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=seg.ndim - 1)
    return jnp.where(seg > 0, idx - start_idx, 0).astype(jnp.int32)


__all__: Sequence[str] = (
    "Qwen3Config", "Qwen3", "PagedKVCache", "abstract_model", "param_logical_axes", "sequence_positions",
    "unstack_layers", "DECODE_ATTENTIONS",
    "dtype_name", "DTYPE_NAMES", "REMAT_NAMES", "REMAT_POLICIES", "REMAT_POLICY_NAMES", "ATTENTION_IMPLS",
    "REMAT_OFFLOADED", "check_remat_backend", "blockwise_attention",
)
