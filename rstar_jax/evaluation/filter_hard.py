"""The stage-3 hard set (spec §5.3): drop the training problems the current policy solves k of k.

The paper's stage-2 policy generates 8 rollouts for each of its 42K problems and removes those
solved 8/8, leaving 17.3K. Every problem not solved k of k is written with its original row
content, in the input's format (jsonl lines are copied verbatim; json lists and parquet tables
keep every column).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence

from rstar_jax.evaluation.questions import EvalError

WORK_DIR = "filter_hard"  # under config.run_dir: samples, settings and the summary
SUMMARY_FILE = "summary.json"


def split_by_solved(rewards_by_key: Mapping[str, Sequence[float]], k: int) -> tuple[list[str], list[str]]:
    """(kept, dropped) keys in input order: dropped are the problems solved in all k of k samples."""
    kept, dropped = [], []
    for key, rewards in rewards_by_key.items():
        if len(rewards) != k:
            raise ValueError(f"split_by_solved: problem {key} has {len(rewards)} rewards, expected {k}")
        (dropped if all(r == 1.0 for r in rewards) else kept).append(key)
    return kept, dropped


def _jsonl_rows(path: pathlib.Path) -> list[str]:
    # Row i is the i-th non-blank line, as rstar_jax.data.datasets numbers jsonl rows.
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _json_rows(path: pathlib.Path) -> list:
    return json.loads(path.read_text(encoding="utf-8"))


def write_rows(output: pathlib.Path, fmt: str, selection: Sequence[tuple[pathlib.Path, list[int]]]) -> int:
    """Writes the selected rows of each input (same format as `fmt`) to `output` atomically."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    n = 0
    if fmt == "jsonl":
        with tmp.open("w", encoding="utf-8") as f:
            for path, rows in selection:
                lines = _jsonl_rows(path)
                for row in rows:
                    f.write(lines[row] + "\n")
                    n += 1
    elif fmt == "json":
        kept = []
        for path, rows in selection:
            data = _json_rows(path)
            kept.extend(data[row] for row in rows)
        tmp.write_text(json.dumps(kept, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        n = len(kept)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(path).take(pa.array(rows, pa.int64())) for path, rows in selection]
        try:
            table = pa.concat_tables(tables)
        except pa.ArrowInvalid as e:
            raise EvalError(f"config.filter_hard.input_files: the parquet inputs have different schemas "
                            f"({e})") from None
        pq.write_table(table, tmp)
        n = table.num_rows
    else:
        raise EvalError(f"config.filter_hard.output_file: unsupported format {fmt!r}")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return n

