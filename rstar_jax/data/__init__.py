"""Problem datasets (grain pipelines over jsonl/json/parquet) and synthetic tool-use problems.

The names are loaded on first access (PEP 562): `rstar_jax.data.synthetic` imports no jax (nor
grain), and a config is checked against its generators without loading the dataset pipeline.
"""

from __future__ import annotations

from rstar_jax.lazy import lazy_exports

# name -> the submodule that defines it
_EXPORTS = {
    **{name: "rstar_jax.data.datasets" for name in ("DataError", "Example", "LoadReport", "PromptIterator",
                                                    "load_examples", "read_conversations", "read_examples")},
    **{name: "rstar_jax.data.synthetic" for name in ("BEHAVIOURS", "GENERATORS", "Problem", "SyntheticFiles",
                                                     "ToolResult", "behaviours_for", "generate_problems",
                                                     "held_out_problems", "prepare_synthetic_data",
                                                     "sft_conversation", "write_held_out", "write_problems",
                                                     "write_sft_file")},
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
