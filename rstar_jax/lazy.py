"""Package namespaces whose names load their modules on first use (PEP 562).

The packages a config check reaches (model, parallel, rl, data) export names from modules that import
JAX; loading those on first use lets the jax-free ones (`rstar_jax.model.config`, `rstar_jax.rl.settings`,
...) be imported alone, while `from rstar_jax.rl import grpo_loss` works as it always did.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for the package whose globals are `namespace`: each name of `exports`
    (name -> the module defining it) is imported from that module on first access, then kept."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
