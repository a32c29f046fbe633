"""The Qwen3 policy: model, paged KV cache, logical-axis shardings, Hugging Face I/O."""

from rstar_jax.model.qwen3 import PagedKVCache, Qwen3, Qwen3Config, dtype_name

__all__ = ["Qwen3", "Qwen3Config", "PagedKVCache", "dtype_name"]
