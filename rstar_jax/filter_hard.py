"""The stage-3 hard set (spec §5.3): drop the training problems the current policy solves k of k.

    python -m rstar_jax.filter_hard --config=configs/stage3.py \\
        --config.filter_hard.input_files="('dapo.parquet',)" [--config.model.hf_path=runs/stage2/hf/final]

The paper's stage-2 policy generates 8 rollouts for each of its 42K problems and removes those
solved 8/8, leaving 17.3K. Here: `filter_hard.k` rollouts per problem of `filter_hard.input_files`
(else `data.train_files`) at the config's rollout settings (temperature, T, response budget),
sampled by the same resumable code as `rstar_jax.evaluate` (records in
`<run_dir>/filter_hard/samples.jsonl`), then every problem not solved k of k is written to
`filter_hard.output_file` with its original row content, in the input's format (jsonl lines are
copied verbatim; json lists and parquet tables keep every column). The policy: filter_hard.checkpoint_dir
(an orbax run), model.hf_path, or train.init_from (a stage-3 config's: the stage-2 checkpoints).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence

from rstar_jax.data.datasets import detect_format
from rstar_jax.evaluate import (
    EvalError,
    SampleStore,
    config_command,
    load_questions,
    loop_config,
    policy_source,
    sample_questions,
    sampling_settings,
    write_json,
)

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


def run_filter_hard(config) -> dict:
    """Samples (or resumes), writes the kept rows to filter_hard.output_file; returns the summary."""
    from rstar_jax.config import check_filter_hard

    f, r, d = config.filter_hard, config.rollout, config.data
    inputs = check_filter_hard(config)
    output = pathlib.Path(f.output_file)
    out_fmt = output.suffix.lower().lstrip(".")
    for path in inputs:
        in_fmt = detect_format(pathlib.Path(path), d.format)
        if in_fmt != out_fmt:
            raise EvalError(f"config.filter_hard.output_file: {output} is {out_fmt} but input {path} is {in_fmt}; "
                            f"the hard set keeps the input's format (use a .{in_fmt} output)")
    field = "filter_hard.input_files" if f.input_files else "data.train_files"
    questions, load_report = load_questions(inputs, fmt=d.format, question_key=d.question_key,
                                            answer_key=d.answer_key, on_bad_row=d.on_bad_row, field=field)
    source = policy_source(config, checkpoint_dir=f.checkpoint_dir, checkpoint_step=f.checkpoint_step,
                           generator_urls=f.generator_urls, prefix="filter_hard", fallback_dir=config.train.init_from,
                           fallback_field="train.init_from")
    loop = loop_config(config, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_turns=r.max_turns,
                       response_budget=r.response_budget)
    work = pathlib.Path(config.run_dir) / WORK_DIR
    store = SampleStore(work, sampling_settings(config, loop, k=f.k, files=inputs, source=source))
    groups = sample_questions(config, questions, k=f.k, loop=loop, store=store, source=source, desc="filter_hard")
    kept, dropped = split_by_solved({key: [rec["reward"] for rec in group] for key, group in groups.items()}, f.k)
    kept_set = set(kept)
    selection = [(pathlib.Path(path), [q.row for q in questions if q.file == str(path) and q.key in kept_set])
                 for path in inputs]
    written = write_rows(output, out_fmt, selection)
    summary = {"input_files": list(map(str, inputs)), "output_file": str(output), "k": f.k,
               "problems": len(questions), "kept": len(kept), "dropped_solved_k_of_k": len(dropped),
               "skipped_unusable_rows": load_report.num_skipped, "rows_written": written}
    write_json(work / SUMMARY_FILE, summary)
    print(f"[filter_hard] kept {len(kept)} of {len(questions)} problems, dropped {len(dropped)} solved "
          f"{f.k}/{f.k}" + (f", skipped {load_report.num_skipped} unusable rows" if load_report.num_skipped else "")
          + f" -> {output}", flush=True)
    return summary


def main() -> None:
    from rstar_jax.config import DEFAULT_CONFIG, validate

    def run(config) -> None:
        # A stage-3 config's data.train_files is this command's output: it need not exist yet, so
        # file checks are those of check_filter_hard (inputs, policy), not the RL mode's.
        run_filter_hard(validate(config, check_files=False))

    config_command(DEFAULT_CONFIG, run)


if __name__ == "__main__":
    main()
