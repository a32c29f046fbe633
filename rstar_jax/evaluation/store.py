"""The resumable sample store of an evaluation: `samples.jsonl` plus the settings that drew them.

- `eval_settings.json`: everything that decides the samples (k, sampling, turns, budget, seed, files,
  policy). A restart with different settings is refused: its samples would not be comparable.
- `samples.jsonl`: one `rstar_jax.rollout.records` record per response plus its question key
  (`file#row`); the k records of a question are appended (and fsynced) together as soon as its group
  finishes, so a killed run loses at most the questions in flight and a restart samples only the
  questions without a complete group.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
from collections.abc import Sequence

from rstar_jax.evaluation.questions import EvalError
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.records import append_records, read_records, write_records

SAMPLES_FILE = "samples.jsonl"
SETTINGS_FILE = "eval_settings.json"


def sampling_settings(loop: LoopConfig, *, k: int, files: Sequence[str], policy: dict, tokenizer: dict,
                      template: str, max_prompt_length: int) -> dict:
    """Everything that decides the samples; a resumed run must match it exactly."""
    return {
        "k": int(k),
        "files": [str(f) for f in files],
        "policy": policy,
        "tokenizer": tokenizer,
        "template": template,
        "max_prompt_length": max_prompt_length,
        "temperature": loop.temperature,
        "top_p": loop.top_p,
        "top_k": loop.top_k,
        "max_turns": loop.max_turns,
        "response_budget": loop.response_budget,
        "tool_name": loop.tool_name,
        "max_calls_per_turn": loop.max_calls_per_turn,
        "observation_style": loop.tool_env.observation_style,
        "observation_max_chars": loop.tool_env.observation_max_chars,
        **{f"tool_{name}": value for name, value in loop.tool_env.sandbox_options().items()},
        "tool_call_parsing": loop.tool_env.tool_call_parsing,
        "use_tools": loop.use_tools,
        "seed": loop.seed,
    }


class SampleStore:
    """`<directory>/samples.jsonl` and `<directory>/eval_settings.json`: resumable per-question groups."""

    def __init__(self, directory: str | os.PathLike, settings: dict):
        self.directory = pathlib.Path(directory)
        self.settings = json.loads(json.dumps(settings))  # as it reads back from disk
        self.k = int(settings["k"])
        self.samples_path = self.directory / SAMPLES_FILE
        self.settings_path = self.directory / SETTINGS_FILE
        self._lock_file = None

    def open(self) -> dict[str, list[dict]]:
        """Locks the directory, checks (or writes) the settings and returns the complete groups on disk.

        A torn last line or a question with fewer than k records (the run was killed while writing
        it) is removed from samples.jsonl, so the question is sampled again and appears once.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        has_samples = self.samples_path.exists() and self.samples_path.stat().st_size > 0
        if self.settings_path.exists() and has_samples:
            try:
                saved = json.loads(self.settings_path.read_text())
            except json.JSONDecodeError as e:
                raise EvalError(f"{self.settings_path}: not valid JSON ({e.msg})") from None
            if saved != self.settings:
                changed = sorted(set(saved) | set(self.settings), key=str)
                diffs = [f"{name}: {saved.get(name)!r} -> {self.settings.get(name)!r}" for name in changed
                         if saved.get(name) != self.settings.get(name)]
                raise EvalError(f"{self.directory} holds samples drawn with other settings ({'; '.join(diffs)}); "
                                f"resume with the original settings or choose a new config.run_dir")
        elif has_samples:
            raise EvalError(f"{self.samples_path} exists without {SETTINGS_FILE}: it cannot be resumed safely; "
                            f"choose a new config.run_dir")
        else:  # nothing sampled yet: these settings are the run's
            write_json(self.settings_path, self.settings)
        if not self.samples_path.exists():
            return {}
        torn: list[int] = []
        records = read_records(self.samples_path, on_partial=torn.append)
        groups: dict[str, list[dict]] = {}
        for i, record in enumerate(records):
            if "key" not in record or "sample_index" not in record:
                raise EvalError(f"{self.samples_path}: record {i + 1} has no question key; not an evaluation file")
            groups.setdefault(record["key"], []).append(record)
        complete: dict[str, list[dict]] = {}
        for key, group in groups.items():
            indices = sorted(r["sample_index"] for r in group)
            if len(indices) != len(set(indices)) or len(indices) > self.k:
                raise EvalError(f"{self.samples_path}: question {key} has duplicate samples {indices}; "
                                f"the file was edited or concatenated")
            if indices == list(range(self.k)):
                complete[key] = sorted(group, key=lambda r: r["sample_index"])
        if torn or len(complete) != len(groups):
            kept = [r for r in records if r["key"] in complete]
            write_records(self.samples_path, kept)
        return complete

    def append(self, records: Sequence[dict]) -> None:
        append_records(self.samples_path, records)

    def _lock(self) -> None:
        # Two processes appending to one samples.jsonl would interleave groups; the lock dies with
        # its process, so a killed run never leaves the directory locked.
        if self._lock_file is not None:
            return
        handle = open(self.directory / ".lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise EvalError(f"{self.directory} is in use by another running evaluation") from None
        self._lock_file = handle

    def close(self) -> None:
        """Releases the directory lock."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def write_json(path: pathlib.Path, data) -> None:
    """Atomic JSON write (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
