"""Decode attention for one layer over a paged KV pool: this project's XLA path (the row's pages
gathered, then `single_query_attention`'s two multiply-reduces, as the engine's decode step runs
them) beside the Pallas GPU kernel `jax.experimental.pallas.ops.gpu.paged_attention` (flash
decoding over the pages where they lie; it wants the pool as [KV heads, pages, page size, head
dim]), and beside the limit: the bytes of K and V the rows attend to at the copy bandwidth measured
in this run.

    python benchmarks/decode_attention.py           # Qwen3-1.7B's attention: 16 query heads, 8 KV heads
                                                    # of 128; batch 64, 768 positions, pages of 16
    python benchmarks/decode_attention.py --smoke   # CPU-sized; the kernel in interpret mode (a check of
                                                    # the script and of the two paths' agreement)

Why: the H100 profile of the engine's decode (benchmarks/RESULTS.md, 2026-11-27) spends 43.6% of the
device's time in the XLA path's reductions, reading K at 0.9 TB/s. Before the engine's pool changes
layout for the kernel, this measures what the kernel would give. The outputs of the two paths are
compared first; the last line is `pallas_vs_xla=X.XX` (the best kernel setting's speed over the XLA
path's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention  # noqa: E402

from rstar_jax.model.qwen3 import single_query_attention  # noqa: E402
from ceilings import _best_seconds, copy_bandwidth  # noqa: E402 (benchmarks/ceilings.py)


def xla_path(q, k_pool, v_pool, table, lengths):
    """The engine's decode attention for one layer (qwen3.forward_with_paged_cache with T = 1):
    q [B, H, hd], pools [pages, page size, KV heads, hd], table [B, pages per row], lengths [B]."""
    b, pages = table.shape
    span = pages * k_pool.shape[1]
    k_seq = k_pool.at[table].get(mode="clip").reshape(b, span, *k_pool.shape[2:])
    v_seq = v_pool.at[table].get(mode="clip").reshape(b, span, *v_pool.shape[2:])
    mask = jnp.arange(span)[None, None, :] < lengths[:, None, None]  # [B, 1, span]
    return single_query_attention(q[:, None], k_seq, v_seq, mask)[:, 0]


def padded_table(table: jax.Array, k_splits: int, pages_per_block: int) -> jax.Array:
    """The page table widened with page 0 to a multiple of k_splits x pages_per_block, as the kernel
    needs (its compute blocks are powers of two for Triton): positions past a row's length are
    masked, and splits wholly past it compute nothing."""
    multiple = k_splits * pages_per_block
    return jnp.pad(table, ((0, 0), (0, -table.shape[1] % multiple)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=768, help="positions a row attends to (rows end up to two pages short)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--k-splits", default="8,16", help="the kernel's splits of a row's pages, tried in turn")
    parser.add_argument("--pages-per-block", default="4,8", help="the kernel's pages per compute block, tried in turn")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.length, args.repeats = 4, 64, 2
    interpret = jax.default_backend() != "gpu"  # the kernel lowers through Triton on GPUs only
    dtype = jnp.dtype(args.dtype)
    pages = -(-args.length // args.page_size)
    num_pages = args.batch * pages + 7  # a few never read
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(num_pages)[:args.batch * pages].reshape(args.batch, pages), jnp.int32)
    # Rows end anywhere in their last two pages, as decoding rows do.
    lengths = jnp.asarray(np.maximum(1, args.length - rng.integers(0, 2 * args.page_size, args.batch)), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (num_pages, args.page_size, args.kv_heads, args.head_dim)
    k_pool = jax.random.normal(keys[0], shape, dtype)
    v_pool = jax.random.normal(keys[1], shape, dtype)
    q = jax.random.normal(keys[2], (args.batch, args.heads, args.head_dim), dtype)
    k_pages, v_pages = (jnp.transpose(p, (2, 0, 1, 3)) for p in (k_pool, v_pool))  # the kernel's layout
    q_scaled = (q / np.sqrt(args.head_dim)).astype(dtype)  # the kernel leaves the 1/sqrt(head_dim) to its caller

    bandwidth = copy_bandwidth()
    attended = 2 * int(lengths.sum()) * args.kv_heads * args.head_dim * dtype.itemsize  # K and V
    limit_s = attended / bandwidth
    print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, up to {args.length} positions in pages of "
          f"{args.page_size}, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, {args.dtype}"
          + ("; the kernel in interpret mode" if interpret else ""))
    print(f"limit:  {limit_s * 1e6:9.1f} us  ({attended / 1e6:.1f} MB of K and V at {bandwidth / 1e12:.2f} TB/s, "
          f"the copy bandwidth measured in this run)")

    reference = jax.jit(xla_path)
    expected = np.asarray(reference(q, k_pool, v_pool, table, lengths), np.float32)
    xla_s = _best_seconds(reference, q, k_pool, v_pool, table, lengths, repeats=args.repeats)
    print(f"xla:    {xla_s * 1e6:9.1f} us  ({attended / xla_s / 1e12:.2f} TB/s, {limit_s / xla_s:.1%} of the limit)")
    figures = {"device": jax.devices()[0].device_kind, "args": vars(args), "bandwidth": bandwidth,
               "limit_s": limit_s, "xla_s": xla_s, "pallas": []}
    tolerance = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    for splits in (int(x) for x in args.k_splits.split(",")):
        for block in (int(x) for x in args.pages_per_block.split(",")):
            if splits & (splits - 1) or block & (block - 1):
                raise SystemExit(f"--k-splits and --pages-per-block take powers of two, not {splits} and {block}")
            wide = padded_table(table, splits, block)
            kernel = jax.jit(lambda *a, s=splits, p=block: paged_attention(
                *a, k_splits=s, pages_per_compute_block=p, interpret=interpret))
            got = np.asarray(kernel(q_scaled, k_pages, v_pages, wide, lengths), np.float32)
            difference = float(np.max(np.abs(got - expected) / (tolerance + tolerance * np.abs(expected))))
            seconds = _best_seconds(kernel, q_scaled, k_pages, v_pages, wide, lengths, repeats=args.repeats)
            figures["pallas"].append({"k_splits": splits, "pages_per_compute_block": block, "seconds": seconds,
                                      "matches": difference <= 1.0})
            # Timed even when the outputs differ, so that a lease still gets the figure; the exit says.
            print(f"pallas: {seconds * 1e6:9.1f} us  ({attended / seconds / 1e12:.2f} TB/s, {limit_s / seconds:.1%} "
                  f"of the limit; k_splits={splits}, pages_per_compute_block={block}, table of {wide.shape[1]} "
                  f"pages; outputs {'match' if difference <= 1.0 else 'DIFFER FROM'} the XLA path's, "
                  f"{difference:.2f} of the tolerance)")
    best = min(f["seconds"] for f in figures["pallas"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    print(f"pallas_vs_xla={xla_s / best:.2f}")
    if not all(f["matches"] for f in figures["pallas"]):
        raise SystemExit(f"the kernel's outputs differ from the XLA path's beyond {tolerance} (atol and rtol)")


if __name__ == "__main__":
    main()
