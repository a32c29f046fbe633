"""Trajectories as JSON records in a run directory: what the notebooks and evaluation read back.

One JSON object per trajectory, one file per RL step (`<run_dir>/rollouts/step_000001.jsonl`) or
per evaluation (`<run_dir>/samples.jsonl`). A record keeps the token ids (so entropies can be
recomputed with any policy), the loss mask (which tokens the policy sampled), the decoded text,
the per-call tool statuses and the reward. Files are appended line by line and flushed, so a
killed run keeps every record it wrote; a partial last line (the kill landed mid-write) is
ignored by `read_records`, which reports it instead of failing.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

from rstar_jax.rollout.trajectory import Trajectory

RECORD_VERSION = 1


def trajectory_record(traj: Trajectory, decode, **extra: Any) -> dict:
    """A JSON-ready dict for one trajectory. decode: token ids -> text (special tokens kept)."""
    traj.check()
    record = {
        "version": RECORD_VERSION,
        **extra,
        "group_id": traj.group_id,
        "sample_index": traj.sample_index,
        "question": traj.question,
        "gold_answer": traj.gold_answer,
        "reward": float(traj.reward),
        "finish_reason": traj.finish_reason,
        "truncated": bool(traj.truncated),
        "n_turns": traj.n_turns,
        "n_tool_calls": traj.n_tool_calls,
        "n_tool_errors": traj.n_tool_errors,
        "n_answer_tags": traj.n_answer_tags,
        "tool_statuses": list(traj.tool_statuses),
        "tool_seconds": float(traj.tool_seconds),
        "n_retractions": traj.n_retractions,
        "n_failovers": traj.n_failovers,
        "n_abort_resumes": traj.n_abort_resumes,
        "response_length": len(traj.response_ids),
        "num_sampled_tokens": traj.num_sampled_tokens,
        "policy_version": traj.policy_version,
        # Per response token, run-length coded [[version, count], ...]: -1 marks tool tokens.
        "policy_version_runs": _runs(traj.policy_versions),
        "prompt_ids": [int(t) for t in traj.prompt_ids],
        "response_ids": [int(t) for t in traj.response_ids],
        "loss_mask": [int(m) for m in traj.loss_mask],
        "model_text": traj.extra.get("model_text", ""),
        # The whole response as the policy saw it, tool observations included.
        "response_text": decode(traj.response_ids),
    }
    if "roc_kept" in traj.extra:  # a training rollout: whether RoC kept it for the update
        record["roc_kept"] = bool(traj.extra["roc_kept"])
    return record


def _runs(values) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([int(v), 1])
    return runs


def append_records(path: str | pathlib.Path, records: Iterable[dict]) -> int:
    """Appends records as JSON lines, flushed and fsynced before returning; returns how many."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def write_records(path: str | pathlib.Path, records: Iterable[dict]) -> int:
    """Writes a whole records file atomically (a re-run of the same RL step replaces it)."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        tmp.unlink()
    n = append_records(tmp, records)
    os.replace(tmp, path)
    return n


def read_records(path: str | pathlib.Path, *, on_partial=None) -> list[dict]:
    """Reads a records file; a torn final line is dropped (reported through `on_partial(line_no)`).

    A malformed line anywhere but the end is corruption, not an interrupted write: ValueError
    naming the file and line.
    """
    path = pathlib.Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):  # no trailing newline: the write was cut short
                if on_partial is not None:
                    on_partial(i)
                continue
            raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return records


def rollout_files(run_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The RL run's per-step rollout files in step order."""
    return sorted((pathlib.Path(run_dir) / "rollouts").glob("step_*.jsonl"))


def rollout_path(run_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl"


def iter_rollouts(run_dir: str | pathlib.Path) -> Iterator[dict]:
    """Every stored trajectory of an RL run, each with its `step`."""
    for path in rollout_files(run_dir):
        yield from read_records(path)
