"""The Qwen3 policy: model, paged KV cache, logical-axis shardings, Hugging Face I/O.

Names load lazily (PEP 562) so that `import rstar_jax.model.config` checks a config without jax.
"""

from rstar_jax.lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it
    "Qwen3": "rstar_jax.model.qwen3",
    "PagedKVCache": "rstar_jax.model.qwen3",
    "Qwen3Config": "rstar_jax.model.config",
    "dtype_name": "rstar_jax.model.config",
}

__all__ = ["Qwen3", "Qwen3Config", "PagedKVCache", "dtype_name"]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
