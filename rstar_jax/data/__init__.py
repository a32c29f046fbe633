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
    GENERATORS,
    Problem,
    SyntheticFiles,
    generate_problems,
    prepare_synthetic_data,
    write_held_out,
    sft_conversation,
    write_problems,
    write_sft_file,
)

__all__ = [
    "DataError", "Example", "LoadReport", "PromptIterator", "load_examples",
    "read_conversations", "read_examples", "GENERATORS", "Problem", "generate_problems", "sft_conversation",
    "SyntheticFiles", "prepare_synthetic_data", "write_held_out",
    "write_problems", "write_sft_file",
]
