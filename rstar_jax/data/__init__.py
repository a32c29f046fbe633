"""Problem datasets (grain pipelines over jsonl/json/parquet) and synthetic tool-use problems."""

from rstar_jax.data.datasets import (
    DataError,
    Example,
    LoadReport,
    PromptIterator,
    load_examples,
    read_conversations,
    read_examples,
)
from rstar_jax.data.synthetic import (
    BEHAVIOURS,
    GENERATORS,
    Problem,
    SyntheticFiles,
    ToolResult,
    behaviours_for,
    generate_problems,
    held_out_problems,
    prepare_synthetic_data,
    sft_conversation,
    write_held_out,
    write_problems,
    write_sft_file,
)

__all__ = [
    "DataError", "Example", "LoadReport", "PromptIterator", "load_examples", "read_conversations", "read_examples",
    "BEHAVIOURS", "GENERATORS", "Problem", "SyntheticFiles", "ToolResult", "behaviours_for", "generate_problems",
    "held_out_problems", "prepare_synthetic_data", "sft_conversation", "write_held_out", "write_problems", "write_sft_file",
]
