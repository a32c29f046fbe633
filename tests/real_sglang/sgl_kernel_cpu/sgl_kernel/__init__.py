"""Pure-torch stand-in for the CPU build of `sgl_kernel`, for tests that run a real SGLang server.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1 ... --device cpu`) imports a few helpers from
`sgl_kernel` at module load. Its CPU build is not on PyPI and its source build needs AVX-512/AMX, so
tests/real_sglang/setup.sh puts this directory on the environment's sys.path (a .pth file) instead.
In 0.5.23 none of these helpers runs for a dense model without speculative decoding (a server run
with every name raising still served /generate); `assign_req_to_token_pool_cpu` (used by the
speculative-decoding KV allocation) is implemented anyway, the rest fail loudly if ever called.
"""

import torch

__version__ = "0.0.0+rstar-jax-cpu-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """In place: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]` gets the next
    `end_offset[i] - start_offset[i]` entries of `out_cache_loc`, which holds the new KV slots of
    all requests back to back in batch order (the semantics of SGLang's Triton kernel
    `assign_req_to_token_pool` in sglang/srt/mem_cache/allocation.py)."""
    del pool_len  # the row length; torch indexing knows it from req_to_token itself
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
            offset += n


def _not_implemented(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the rstar_jax test stand-in "
            "(tests/real_sglang/sgl_kernel_cpu); this SGLang code path needs the real CPU kernels")
    stub.__name__ = stub.__qualname__ = name
    return stub


# Imported at module level by SGLang 0.5.23's CPU paths (kv-cache moves, speculative decoding);
# never called by the tests' configuration. A new SGLang version that imports more names fails at
# import with "cannot import name X from sgl_kernel": add X here.
for _name in ("copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu", "build_tree_kernel_efficient_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu"):
    globals()[_name] = _not_implemented(_name)
del _name
