"""The Qwen3 policy: model, KV cache, Hugging Face I/O."""

from rstar_jax.model.qwen3 import KVCache, PagedKVCache, Qwen3, Qwen3Config

__all__ = ["Qwen3", "Qwen3Config", "KVCache", "PagedKVCache"]
