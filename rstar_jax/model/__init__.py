"""The Qwen3 policy: model, paged KV cache, logical-axis shardings, Hugging Face I/O.

Names load lazily (PEP 562) so that `import rstar_jax.model.config` checks a config without jax.
"""

import importlib

_EXPORTS = {  # name -> the submodule that defines it
    "Qwen3": "rstar_jax.model.qwen3",
    "PagedKVCache": "rstar_jax.model.qwen3",
    "Qwen3Config": "rstar_jax.model.config",
    "dtype_name": "rstar_jax.model.config",
}

__all__ = ["Qwen3", "Qwen3Config", "PagedKVCache", "dtype_name"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
