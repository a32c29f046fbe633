"""Decode attention by the Pallas GPU kernel `jax.experimental.pallas.ops.gpu.paged_attention`
(flash decoding over the pages where they lie), for a KV pool laid out heads first.

The kernel reads one layer's pool as [KV heads, pages, page size, head dim]. A heads-first pool
(`PagedKVCache.heads_first`: [KV heads, layers, pages, page size, head dim]) is that for every layer
at once: merging its layer and page axes is a free reshape, and layer l's page p is page l x pages + p
of the merged pool. So each layer's call reads the whole pool through a page table offset by its
layer, and nothing is sliced, copied or transposed per layer (a slice of a scanned carry would be a
copy of the layer's pool on GPU).

The kernel leaves the 1/sqrt(head dim) scaling to its caller (done here, on the query) and wants its
page table a multiple of k_splits x pages_per_compute_block wide; entries past a row's length are
masked but read, so they must name real pages: the table is clipped into the pool and widened with
page 0. On a non-GPU backend the kernel runs in interpret mode (a test of the program, slow).
Over a mesh it runs under `jax.shard_map`: where the "tensor" axis splits the KV heads, each device
attends with its own heads over its own share of the pool; the other axes repeat the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# The kernel's work split: a row's pages in at most MAX_K_SPLITS partitions (reduced across them
# afterwards), each walked PAGES_PER_COMPUTE_BLOCK pages at a time. benchmarks/decode_attention.py
# measures the alternatives on a GPU.
MAX_K_SPLITS = 16
PAGES_PER_COMPUTE_BLOCK = 8
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
MIN_BLOCK = 16  # Triton's dot wants every dimension of its operands at least 16


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def kernel_blocks(table_pages: int, page_size: int) -> tuple[int, int, int]:
    """(k_splits, pages_per_compute_block, padded table width) for a page table `table_pages` wide:
    compute blocks of a power of two pages holding at least 16 positions (Triton's dot), as many
    splits as the table fills (at most MAX_K_SPLITS), the table widened to a multiple of both."""
    least = _pow2_ceil(-(-MIN_BLOCK // page_size))
    block = max(min(PAGES_PER_COMPUTE_BLOCK, _pow2_ceil(table_pages)), least)
    splits = min(MAX_K_SPLITS, _pow2_floor(-(-table_pages // block)))
    multiple = splits * block
    return splits, block, -(-table_pages // multiple) * multiple


def unsupported(*, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, tensor: int = 1) -> list[str]:
    """Why the kernel cannot serve these shapes (empty when it can). Checked on every backend, so
    that what runs in interpret mode on a CPU also lowers through Triton on a GPU: loads of whole
    compute blocks ([pages, page size, head dim]) must be powers of two in size, the dots at least
    16 wide; the tensor axis must split the KV heads evenly (the shard_map's split)."""
    problems = []
    if head_dim < MIN_BLOCK or head_dim & (head_dim - 1):
        problems.append(f"head_dim {head_dim} must be a power of two >= {MIN_BLOCK}")
    if page_size & (page_size - 1):
        problems.append(f"page_size {page_size} must be a power of two")
    if num_heads % num_kv_heads:
        problems.append(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if jnp.dtype(dtype).name not in KERNEL_DTYPES:
        problems.append(f"the KV pool's dtype {jnp.dtype(dtype).name} must be one of {KERNEL_DTYPES}")
    if tensor > 1 and num_kv_heads % tensor:
        problems.append(f"num_kv_heads {num_kv_heads} must divide over the mesh's tensor axis ({tensor}): the "
                        f"kernel runs per device on its own KV heads")
    return problems


def _interpret(mesh) -> bool:
    """The kernel lowers through Triton on GPUs only; elsewhere it is interpreted."""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return platform != "gpu"


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer, page_table: jax.Array,
                           lengths: jax.Array, *, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """One query per row against its first `lengths[b]` positions in layer `layer` of a heads-first
    pool: q [B, H, hd], pools [Hkv, layers, pages, page size, hd], page_table [B, W] (entries >=
    pages mark unallocated pages), lengths [B] int32 (0: the row attends to nothing and gets zeros).
    Returns [B, H, hd] in q's dtype. `mesh`: the pool's (its "tensor" axis splitting the KV heads
    when larger than 1)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention  # only this path needs Pallas

    kv_heads, layers, pages, page_size, head_dim = k_pool.shape
    splits, block, width = kernel_blocks(page_table.shape[1], page_size)
    table = jnp.minimum(page_table, pages - 1) + layer * pages  # this layer's pages in the merged pool
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))  # past every row's length: masked
    scaled = (q.astype(jnp.float32) / np.sqrt(head_dim)).astype(k_pool.dtype)
    kernel = functools.partial(paged_attention, k_splits=splits, pages_per_compute_block=block,
                               interpret=_interpret(mesh))

    def attend(q, k_pool, v_pool, table, lengths):
        merged = (k_pool.shape[0], layers * pages, page_size, head_dim)  # a reshape, no copy
        return kernel(q, k_pool.reshape(merged), v_pool.reshape(merged), table, lengths)

    if mesh is not None and mesh.size > 1:
        # Always manual over a mesh: the partitioner cannot split a kernel's custom call, so each
        # device runs it on its KV heads (its share of the pool) and the rest of the mesh repeats it.
        split = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
        heads, pool = P(None, split, None), P(split)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(heads, pool, pool, P(), P()), out_specs=heads,
                               check_vma=False)
    return attend(scaled, k_pool, v_pool, table, lengths.astype(jnp.int32)).astype(q.dtype)
