"""Problem datasets (grain pipelines over jsonl/json/parquet) and synthetic tool-use problems.

The names are loaded on first access (PEP 562): `rstar_jax.data.synthetic` imports no jax (nor
grain), and a config is checked against its generators without loading the dataset pipeline.
"""

from __future__ import annotations

import importlib

# name -> the submodule that defines it
_EXPORTS = {
    **{name: "datasets" for name in ("DataError", "Example", "LoadReport", "PromptIterator", "load_examples",
                                     "read_conversations", "read_examples")},
    **{name: "synthetic" for name in ("BEHAVIOURS", "GENERATORS", "Problem", "SyntheticFiles", "ToolResult",
                                      "behaviours_for", "generate_problems", "held_out_problems",
                                      "prepare_synthetic_data", "sft_conversation", "write_held_out",
                                      "write_problems", "write_sft_file")},
}

__all__ = [
    "DataError", "Example", "LoadReport", "PromptIterator", "load_examples", "read_conversations", "read_examples",
    "BEHAVIOURS", "GENERATORS", "Problem", "SyntheticFiles", "ToolResult", "behaviours_for", "generate_problems",
    "held_out_problems", "prepare_synthetic_data", "sft_conversation", "write_held_out", "write_problems", "write_sft_file",
]


def __getattr__(name: str):
    try:
        submodule = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__})
