"""Loading and aggregating a run directory for the analysis notebooks.

A run directory (written by `python -m rstar_jax.launch`) holds
- `metrics.jsonl`: one line per logged step. SFT lines carry `sft/*` keys, RL lines `rollout/*`
  keys; both number their steps from 1, so lines are told apart by their keys, not their steps.
- `rollouts/step_NNNNNN.jsonl`: every trajectory of every RL step (`rstar_jax.rollout.records`).
- `checkpoints/<step>/config/metadata`: the run's config as JSON (written by the checkpointer).
- `hf/step_N`, `hf/sft_warmup`, `hf/final`: Hugging Face exports of the policy.

Metrics become "frames": dicts of equally long numpy arrays, one per metric name, with NaN where a
line lacks the metric (skipped updates log no loss, for instance). The notebooks only plot what
this module returns, so every number they show can be unit-tested here.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import math
import pathlib
import random
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rstar_jax.agent.stats import PARSE_ERROR, is_tool_error
from rstar_jax.analysis.entropy import (LABEL_CODE, LABEL_FORKING, LABEL_REFLECTION, TokenEntropyRecord,
                                        analyse_trajectory, trajectory_entropies)
from rstar_jax.rollout.records import read_records, rollout_files
from rstar_jax.train.checkpoint import stored_config
from rstar_jax.train.metrics import read_metrics

SFT_PREFIX = "sft/"
RL_PREFIX = "rollout/"
EVAL_PREFIX = "eval/"
STEP = "step"

# Display order of tool statuses: success, then sandbox_service's closed set, then malformed calls.
STATUS_ORDER = ("ok", "runtime_error", "timeout", "memory_limit", "output_limit", "killed_by_signal", "rejected",
                "sandbox_error", PARSE_ERROR)

LABEL_COLOURS = {LABEL_FORKING: "#f4a261", LABEL_REFLECTION: "#e76f51", LABEL_CODE: "#8ecae6"}
TOOL_TOKEN_COLOUR = "#e9ecef"


# -- metrics --------------------------------------------------------------------------------------

def split_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, list[dict]]:
    """Separates metric lines into `sft` (any `sft/*` key), `rl` (any `rollout/*` key), `eval` (RL's
    held-out evaluations: `eval/*` keys) and `other`."""
    out: dict[str, list[dict]] = {"sft": [], "rl": [], "eval": [], "other": []}
    for i, record in enumerate(records):
        if STEP not in record:
            raise ValueError(f"metrics line {i + 1} has no {STEP!r} field: {sorted(record)[:8]}")
        if any(key.startswith(SFT_PREFIX) for key in record):
            out["sft"].append(dict(record))
        elif any(key.startswith(RL_PREFIX) for key in record):
            out["rl"].append(dict(record))
        elif any(key.startswith(EVAL_PREFIX) for key in record):
            out["eval"].append(dict(record))
        else:
            out["other"].append(dict(record))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, bool))


def metric_frame(records: Sequence[Mapping[str, Any]], *, where: str = "metrics") -> dict[str, np.ndarray]:
    """Columns of the numeric metrics in `records`, sorted by step; NaN where a line lacks a metric.

    `step` is an int64 column; every other numeric key becomes a float64 column (booleans as 0/1).
    Non-numeric values (lists, strings) are left out. When a step occurs more than once (a resumed
    run that did not drop its re-logged lines), the last line wins and a warning names the steps.
    """
    by_step: dict[int, Mapping[str, Any]] = {}
    duplicates = []
    for record in records:
        step = int(record[STEP])
        if step in by_step:
            duplicates.append(step)
        by_step[step] = record
    if duplicates:
        warnings.warn(f"{where}: steps logged more than once (the last line is used): {sorted(set(duplicates))}",
                      stacklevel=2)
    steps = sorted(by_step)
    names: list[str] = []
    seen = set()
    for step in steps:
        for key, value in by_step[step].items():
            if key not in seen and key != STEP and _is_number(value):
                seen.add(key)
                names.append(key)
    frame = {STEP: np.asarray(steps, np.int64)}
    for name in names:
        column = np.full(len(steps), np.nan)
        for i, step in enumerate(steps):
            value = by_step[step].get(name)
            if _is_number(value):
                column[i] = float(value)
        frame[name] = column
    return frame


def frame_length(frame: Mapping[str, np.ndarray]) -> int:
    return len(frame[STEP]) if STEP in frame else 0


def column(frame: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """A frame's column, or all-NaN when the run never logged that metric (older runs, other modes)."""
    if name in frame:
        return frame[name]
    return np.full(frame_length(frame), np.nan)


@dataclasses.dataclass
class RunData:
    """Everything the notebooks read from one run directory."""

    run_dir: pathlib.Path
    name: str
    stage: str
    sft: dict[str, np.ndarray]  # SFT warm-up or SFT-stage lines
    rl: dict[str, np.ndarray]  # RL lines (rollout/*, update/*, roc/*, time/*, lr)
    eval: dict[str, np.ndarray]  # held-out evaluations during RL (eval/*; step 0 is the starting policy)
    other: list[dict]  # lines that are neither (kept so nothing is dropped unseen)
    config: dict | None

    @property
    def num_sft_steps(self) -> int:
        return frame_length(self.sft)

    @property
    def num_rl_steps(self) -> int:
        return frame_length(self.rl)


def locate(run_dir: str | pathlib.Path) -> pathlib.Path:
    """`run_dir`, or, when it is relative and not found from the working directory, the first
    directory above the working directory that holds it: a notebook's kernel starts in notebooks/,
    while `runs/` sits in the repository root."""
    path = pathlib.Path(run_dir)
    if path.is_absolute() or path.exists():
        return path
    return next((parent / path for parent in pathlib.Path.cwd().parents if (parent / path).exists()), path)


def load_run(run_dir: str | pathlib.Path, name: str | None = None) -> RunData:
    """Reads `<run_dir>/metrics.jsonl` (and the stored config) into SFT and RL frames."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    parts = split_metrics(read_metrics(path))
    config = stored_config(run_dir)
    stage = str(config.get("stage")) if config and config.get("stage") else ""
    if not stage:
        files = rollout_files(run_dir)
        first = read_records(files[0]) if files else []
        stage = str(first[0].get("stage", "")) if first else ""
    return RunData(run_dir=run_dir, name=name or run_dir.name, stage=stage or run_dir.name,
                   sft=metric_frame(parts["sft"], where=f"{path} (sft)"),
                   rl=metric_frame(parts["rl"], where=f"{path} (rl)"),
                   eval=metric_frame(parts["eval"], where=f"{path} (eval)"), other=parts["other"], config=config)


def concat_rl(runs: Sequence[RunData]) -> tuple[dict[str, np.ndarray], list[tuple[int, str]]]:
    """The RL frames of consecutive stages on one axis.

    Returns the joined frame with a `global_step` column (each run's steps shifted by the last
    global step of the runs before it) and the stage boundaries as (first global step, label).
    Runs without RL lines are skipped.
    """
    joined, boundaries, _ = _concat(runs)
    return joined, boundaries


def concat_eval(runs: Sequence[RunData]) -> dict[str, np.ndarray]:
    """The held-out evaluations of consecutive stages on `concat_rl`'s axis (`global_step`)."""
    return _concat(runs)[2]


def _concat(runs: Sequence[RunData]):
    rl_pieces, eval_pieces, boundaries, offset = [], [], [], 0
    for run in runs:
        if run.num_rl_steps == 0:
            continue
        steps = run.rl[STEP]
        rl_pieces.append((run.rl, steps + offset))
        if frame_length(run.eval):
            eval_pieces.append((run.eval, run.eval[STEP] + offset))
        boundaries.append((int(steps[0] + offset), run.stage if run.stage == run.name else f"{run.stage} ({run.name})"))
        offset += int(steps[-1])
    return _join(rl_pieces), boundaries, _join(eval_pieces)


def _join(pieces) -> dict[str, np.ndarray]:
    names: list[str] = []
    for frame, _ in pieces:
        names += [n for n in frame if n not in names]
    joined = {"global_step": np.concatenate([g for _, g in pieces]) if pieces else np.zeros(0, np.int64)}
    for name in names:
        joined[name] = np.concatenate([column(frame, name) for frame, _ in pieces])
    if STEP in joined:
        joined[STEP] = joined[STEP].astype(np.int64)
    return joined


# -- rollouts and tool use ------------------------------------------------------------------------

_SEEDED_RUN = re.compile(r"(?P<variant>.+)_seed(?P<seed>\d+)")


@dataclasses.dataclass
class Comparison:
    """Variants of a recipe run over seeds (`benchmarks/learning.py`, `benchmarks/roc_effect.py`):
    per variant, the seeds and each metric as a [seeds, evaluations] array (NaN where a run has no
    value), the evaluations at `steps` (the first run's; the others must match)."""

    steps: np.ndarray
    seeds: dict[str, list[int]]
    values: dict[str, dict[str, np.ndarray]]

    def mean(self, variant: str, name: str) -> np.ndarray:
        with warnings.catch_warnings():  # an evaluation without a value in any seed stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(self.values[variant][name], axis=0)

    def std(self, variant: str, name: str) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanstd(self.values[variant][name], axis=0)

    def paired_difference(self, a: str, b: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Per evaluation, the mean over seeds of b − a (the seeds both ran: a seed's variants share
        its warm-up, so they pair) and that mean in its standard errors (NaN below two seeds)."""
        shared = sorted(set(self.seeds[a]) & set(self.seeds[b]))
        rows_a = self.values[a][name][[self.seeds[a].index(s) for s in shared]]
        rows_b = self.values[b][name][[self.seeds[b].index(s) for s in shared]]
        d = rows_b - rows_a
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            n = np.sum(~np.isnan(d), axis=0)
            mean = np.nanmean(d, axis=0)
            se = np.nanstd(d, axis=0, ddof=1) / np.sqrt(n)
            return mean, np.where(n >= 2, mean / se, np.nan)


def load_comparison(out_dir: str | pathlib.Path, names: Sequence[str] = ("eval/pass@1", "eval/tool_error_rate_positive")
                    ) -> Comparison:
    """Every `<variant>_seed<N>` run directory under `out_dir` (a benchmark's `--out`), with the
    held-out evaluations' `names` against the RL step. Runs with no evaluation are refused (a run
    still going or one that failed), naming the directory."""
    out_dir = locate(out_dir)
    found = sorted((m["variant"], int(m["seed"]), path) for path in out_dir.iterdir()
                   if path.is_dir() and (m := _SEEDED_RUN.fullmatch(path.name)) and m["variant"] != "sft")
    if not found:
        raise FileNotFoundError(f"{out_dir} holds no <variant>_seed<N> run directories")
    steps = None
    seeds: dict[str, list[int]] = {}
    rows: dict[str, dict[str, list[np.ndarray]]] = {}
    for variant, seed, path in found:
        evaluations = load_run(path).eval
        if not frame_length(evaluations):
            raise ValueError(f"{path}: no held-out evaluation in its metrics.jsonl (unfinished or failed?)")
        if steps is None:
            steps = evaluations[STEP]
        elif not np.array_equal(evaluations[STEP], steps):
            raise ValueError(f"{path}: evaluated at steps {evaluations[STEP].tolist()}, the others at {steps.tolist()}")
        seeds.setdefault(variant, []).append(seed)
        for name in names:
            rows.setdefault(variant, {}).setdefault(name, []).append(column(evaluations, name))
    return Comparison(steps=steps, seeds=seeds,
                      values={v: {n: np.stack(r) for n, r in by_name.items()} for v, by_name in rows.items()})


def load_rollouts(run_dir: str | pathlib.Path, steps: Iterable[int] | None = None) -> list[dict]:
    """The stored trajectories of an RL run (optionally of some steps only), in step order."""
    files = rollout_files(run_dir)
    wanted = None if steps is None else {int(s) for s in steps}
    out = []
    for path in files:
        step = int(path.stem.split("_")[-1])
        if wanted is None or step in wanted:
            out.extend(read_records(path))
    if wanted is not None:
        found = {int(r["step"]) for r in out}
        missing = sorted(wanted - found)
        if missing:
            raise ValueError(f"{run_dir}: no stored rollouts for steps {missing}")
    return out


_REQUIRED = ("step", "reward", "n_tool_calls", "n_tool_errors", "tool_statuses")


def _where(record: Mapping[str, Any], index: int) -> str:
    return (f"rollout record {index} (step {record.get('step')}, group {record.get('group_id')}, "
            f"sample {record.get('sample_index')})")


def _checked(record: Mapping[str, Any], index: int) -> tuple[int, list[str]]:
    """(step, tool statuses) of a record whose tool counts agree with its statuses."""
    for field in _REQUIRED:
        if field not in record:
            raise ValueError(f"{_where(record, index)} has no {field!r} field")
    statuses = [str(s) for s in record["tool_statuses"]]
    if len(statuses) != int(record["n_tool_calls"]):
        raise ValueError(f"{_where(record, index)}: n_tool_calls={record['n_tool_calls']} but "
                         f"{len(statuses)} tool_statuses")
    errors = sum(is_tool_error(s) for s in statuses)
    if errors != int(record["n_tool_errors"]):
        raise ValueError(f"{_where(record, index)}: n_tool_errors={record['n_tool_errors']} but {errors} "
                         f"non-ok tool_statuses {statuses}")
    return int(record["step"]), statuses


def _rate(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def tool_use_by_step(records: Sequence[Mapping[str, Any]], *, correct_threshold: float = 0.5) -> dict[str, np.ndarray]:
    """Per-step tool use recomputed from trajectories (a tool error is any status other than ok).

    Counts: `trajectories`, `positive`, `negative`, `tool_calls[_positive|_negative]`,
    `tool_errors[...]`; means: `tool_calls_mean[...]` (calls per trajectory); rates:
    `tool_error_rate[...]` = errors / calls, NaN where a step has no calls in that class (the
    metrics writer logs 0.0 there). A trajectory is positive when its reward exceeds
    `correct_threshold`, as in `rstar_jax.rollout.stats`.
    """
    acc: dict[int, np.ndarray] = {}
    for i, record in enumerate(records):
        step, statuses = _checked(record, i)
        positive = float(record["reward"]) > correct_threshold
        errors = sum(is_tool_error(s) for s in statuses)
        row = acc.setdefault(step, np.zeros(6))
        cls = 0 if positive else 1
        row[cls] += 1  # trajectories
        row[2 + cls] += len(statuses)  # calls
        row[4 + cls] += errors
    steps = sorted(acc)
    table = np.asarray([acc[s] for s in steps]).reshape(len(steps), 6)
    pos, neg = table[:, 0], table[:, 1]
    calls_p, calls_n, err_p, err_n = table[:, 2], table[:, 3], table[:, 4], table[:, 5]
    out = {
        STEP: np.asarray(steps, np.int64),
        "trajectories": pos + neg,
        "positive": pos,
        "negative": neg,
        "pass_rate": _rate(pos, pos + neg),
        "tool_calls": calls_p + calls_n,
        "tool_calls_positive": calls_p,
        "tool_calls_negative": calls_n,
        "tool_errors": err_p + err_n,
        "tool_errors_positive": err_p,
        "tool_errors_negative": err_n,
    }
    for suffix, calls, errors, count in (("", calls_p + calls_n, err_p + err_n, pos + neg),
                                          ("_positive", calls_p, err_p, pos), ("_negative", calls_n, err_n, neg)):
        out[f"tool_calls_mean{suffix}"] = _rate(calls, count)
        out[f"tool_error_rate{suffix}"] = _rate(errors, calls)
    return out


CROSS_CHECKED = ("pass_rate", "tool_calls_mean", "tool_calls_mean_positive", "tool_calls_mean_negative",
                 "tool_error_rate", "tool_error_rate_positive", "tool_error_rate_negative")


@dataclasses.dataclass
class CrossCheck:
    """`cross_check_tool_use`'s findings: steps on one side only, and values that disagree."""

    missing: list[str]
    mismatched: list[str]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched


def cross_check_tool_use(by_step: Mapping[str, np.ndarray], rl_frame: Mapping[str, np.ndarray], *,
                         atol: float = 1e-9) -> CrossCheck:
    """Compares `tool_use_by_step` with the logged `rollout/*` metrics of the same steps.

    A ratio without a denominator is NaN here and absent from the log (0.0 in runs written before
    that; those match too). A step with
    rollouts but no metrics line (a run killed between the two writes) is reported as missing.
    """
    missing, mismatched = [], []
    logged = {int(s): i for i, s in enumerate(rl_frame.get(STEP, []))}
    ours = {int(s): i for i, s in enumerate(by_step[STEP])}
    for step in sorted(set(logged) - set(ours)):
        missing.append(f"step {step}: logged in metrics.jsonl but has no stored rollouts")
    for step in sorted(set(ours) - set(logged)):
        missing.append(f"step {step}: stored rollouts but no metrics line")
    for step in sorted(set(ours) & set(logged)):
        for name in CROSS_CHECKED:
            key = RL_PREFIX + name
            if key not in rl_frame:
                continue
            mine, theirs = float(by_step[name][ours[step]]), float(rl_frame[key][logged[step]])
            if math.isnan(mine) and (math.isnan(theirs) or theirs == 0.0):
                continue
            if math.isnan(mine) or math.isnan(theirs) or abs(mine - theirs) > atol:
                mismatched.append(f"step {step}: {name} recomputed {mine:.6g}, logged {theirs:.6g}")
    return CrossCheck(missing=missing, mismatched=mismatched)


def tool_calls_per_trajectory(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
    return np.asarray([int(r["n_tool_calls"]) for r in records], np.int64)


def _status_key(status: str) -> tuple[int, str]:
    return (STATUS_ORDER.index(status) if status in STATUS_ORDER else len(STATUS_ORDER), status)


def tool_status_counts(records: Sequence[Mapping[str, Any]], *,
                       correct_threshold: float = 0.5) -> dict[str, dict[str, int]]:
    """Tool calls by status, in `positive` and `negative` trajectories (statuses in display order)."""
    counts = {"positive": collections.Counter(), "negative": collections.Counter()}
    for i, record in enumerate(records):
        _, statuses = _checked(record, i)
        cls = "positive" if float(record["reward"]) > correct_threshold else "negative"
        counts[cls].update(statuses)
    order = sorted(set(counts["positive"]) | set(counts["negative"]), key=_status_key)
    return {cls: {s: counts[cls][s] for s in order} for cls in counts}


def tool_status_by_step(records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Tool calls per step by status: `step` plus one count column per status seen (display order)."""
    acc: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, record in enumerate(records):
        step, statuses = _checked(record, i)
        acc[step].update(statuses)  # a step whose trajectories made no call still gets a row
    steps = sorted(acc)
    order = sorted({s for counter in acc.values() for s in counter}, key=_status_key)
    out = {STEP: np.asarray(steps, np.int64)}
    for status in order:
        out[status] = np.asarray([acc[step][status] for step in steps], np.int64)
    return out


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean of the finite values among the last `window` positions (NaN stays NaN)."""
    values = np.asarray(values, np.float64)
    if window < 1:
        raise ValueError(f"moving_average: window must be >= 1, got {window}")
    out = np.full(values.shape, np.nan)
    for i in range(len(values)):
        if np.isnan(values[i]):
            continue
        recent = values[max(0, i - window + 1):i + 1]
        out[i] = recent[~np.isnan(recent)].mean()
    return out


# -- policy and tokenizer -------------------------------------------------------------------------

_STEP_EXPORT = re.compile(r"step_(\d+)$")


def hf_exports(run_dir: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """The run's Hugging Face exports by name (`step_N`, `sft_warmup`, `final`)."""
    directory = pathlib.Path(run_dir) / "hf"
    if not directory.is_dir():
        return {}
    return {p.name: p for p in sorted(directory.iterdir()) if (p / "config.json").is_file()}


def find_hf_export(run_dir: str | pathlib.Path, step: int | str | None = None) -> pathlib.Path:
    """The export of RL step `step` (or a named one: "final", "sft_warmup"); None: the latest policy
    (`final` when the stage finished, else the highest `step_N`)."""
    exports = hf_exports(run_dir)
    if step is not None:
        name = f"step_{int(step)}" if isinstance(step, int) or str(step).isdigit() else str(step)
        if name not in exports:
            raise FileNotFoundError(f"{run_dir}/hf has no export {name!r}; available: {sorted(exports) or 'none'}")
        return exports[name]
    if "final" in exports:
        return exports["final"]
    numbered = sorted((int(m.group(1)), p) for n, p in exports.items() if (m := _STEP_EXPORT.match(n)))
    if numbered:
        return numbered[-1][1]
    if "sft_warmup" in exports:
        return exports["sft_warmup"]
    raise FileNotFoundError(f"{run_dir}/hf holds no Hugging Face export (set checkpoint.export_hf_every "
                            f"or checkpoint.export_hf_final)")


def tokenizer_for_run(run_dir: str | pathlib.Path, tokenizer: str | None = None):
    """The run's tokenizer: `tokenizer` ("byte" or a tokenizer.json path/directory) when given, else
    the one named by the stored config (tokenizer.kind, tokenizer.path or model.hf_path)."""
    from rstar_jax.agent.tokenizer import load_tokenizer

    if tokenizer:
        return load_tokenizer("byte") if tokenizer == "byte" else load_tokenizer("hf", tokenizer)
    config = stored_config(run_dir)
    if config is None:
        raise ValueError(f"{run_dir} has no stored config (no checkpoint): pass the tokenizer explicitly "
                         f"(\"byte\" or a tokenizer.json path)")
    section = config.get("tokenizer", {})
    kind = section.get("kind", "hf")
    path = section.get("path") or config.get("model", {}).get("hf_path") or None
    return load_tokenizer(kind, path)


class CompiledPolicy:
    """A model whose `hidden_states` and `unembedding` run as compiled functions.

    `trajectory_entropies` calls the model eagerly, one operation at a time, which costs about a
    second per trajectory even for the tiny model; compiled, a trajectory takes milliseconds.
    One compilation per input length: `analyse_records` pads lengths to buckets.
    """

    def __init__(self, model):
        import jax
        from flax import nnx

        graphdef, self._state = nnx.split(model)
        self.config = getattr(model, "config", None)
        self._hidden = jax.jit(lambda state, ids: nnx.merge(graphdef, state).hidden_states(ids))
        self._unembedding = jax.jit(lambda state: nnx.merge(graphdef, state).unembedding())

    def hidden_states(self, input_ids):
        return self._hidden(self._state, input_ids)

    def unembedding(self):
        return self._unembedding(self._state)


def load_policy(path: str | pathlib.Path) -> CompiledPolicy:
    """An HF export (e.g. `find_hf_export(run_dir)`) on the default device, ready for entropies."""
    from rstar_jax.model.hf import load_pretrained

    return CompiledPolicy(load_pretrained(path))


# -- token entropy --------------------------------------------------------------------------------

def sample_records(records: Sequence[Mapping[str, Any]], n: int, *, seed: int = 0) -> list[Mapping[str, Any]]:
    """`n` trajectories drawn at random without replacement (all of them when fewer), in stored order."""
    if n >= len(records):
        return list(records)
    chosen = sorted(random.Random(seed).sample(range(len(records)), n))
    return [records[i] for i in chosen]


def padded_length(length: int, bucket: int, limit: int | None = None) -> int:
    """`length` rounded up to a multiple of `bucket`, but never past `limit` (unless length is)."""
    if bucket <= 1:
        return length
    padded = -(-length // bucket) * bucket
    if limit is not None:
        padded = max(length, min(padded, limit))
    return padded


def analyse_records(policy, tokenizer, records: Sequence[Mapping[str, Any]], *, top_fraction: float = 0.2,
                    reflection_window: int = 16, chunk_size: int = 1024,
                    bucket: int = 128) -> list[TokenEntropyRecord]:
    """Per-token entropies (`trajectory_entropies`) and their classification (`analyse_trajectory`)
    for stored trajectories.

    Each sequence is padded at the end to a multiple of `bucket` tokens so that trajectories of
    similar length share one compilation; a causal model's entropies at the real positions do not
    depend on what follows them, and the padded tail is cut off.
    """
    limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    decode_token = lambda token: tokenizer.decode([token], skip_special_tokens=False)  # noqa: E731
    out = []
    for i, record in enumerate(records):
        for field in ("prompt_ids", "response_ids", "loss_mask"):
            if field not in record:
                raise ValueError(f"{_where(record, i)} has no {field!r} field")
        prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
        if len(record["loss_mask"]) != len(response):
            raise ValueError(f"{_where(record, i)}: {len(record['loss_mask'])} loss_mask entries for "
                             f"{len(response)} response tokens")
        total = len(prompt) + len(response)
        pad = padded_length(total, bucket, limit) - total
        entropy = trajectory_entropies(policy, prompt, response + [tokenizer.pad_id] * pad,
                                       chunk_size=chunk_size)[:len(response)]
        out.append(analyse_trajectory(response, record["loss_mask"], entropy, decode_token,
                                      top_fraction=top_fraction, reflection_window=reflection_window))
    return out


def label_counts(analysed: Iterable[TokenEntropyRecord]) -> dict[str, int]:
    """Flagged tokens per class (forking, reflection, code) over all trajectories."""
    total = {LABEL_FORKING: 0, LABEL_REFLECTION: 0, LABEL_CODE: 0}
    for record in analysed:
        for label, n in record.counts().items():
            total[label] += n
    return total


def sampled_entropies(analysed: Iterable[TokenEntropyRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(entropies of every sampled token, entropies of the flagged ones) over all trajectories."""
    every, flagged = [], []
    for record in analysed:
        mask = np.asarray(record.loss_mask, bool)
        entropy = np.asarray(record.entropy, np.float64)
        flags = np.asarray(record.flagged, bool)
        every.append(entropy[mask])
        flagged.append(entropy[flags])
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
    return cat(every), cat(flagged)


def top_tokens(analysed: Iterable[TokenEntropyRecord], k: int = 20,
               label: str | None = None) -> list[tuple[str, int, float]]:
    """The `k` most frequent flagged tokens as (decoded text, count, mean entropy), optionally of one
    class; ties broken by text so the order is deterministic."""
    counts: collections.Counter = collections.Counter()
    sums: dict[str, float] = collections.defaultdict(float)
    for record in analysed:
        for text, flag, lab, entropy in zip(record.token_texts, record.flagged, record.labels, record.entropy):
            if flag and (label is None or lab == label):
                counts[text] += 1
                sums[text] += entropy
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]
    return [(text, n, sums[text] / n) for text, n in ranked]


def render_trajectory_html(record: TokenEntropyRecord, *, title: str = "") -> str:
    """The response as HTML: flagged tokens coloured by class (with their entropy on hover), tool
    output and forced tokens (loss mask 0) on a grey background."""
    parts = ['<div class="rstar-trajectory" style="font-family:monospace;white-space:pre-wrap;'
             'line-height:1.5;border:1px solid #ccc;padding:6px;margin:6px 0">']
    if title:
        parts.append(f"<div style=\"font-weight:bold;margin-bottom:4px\">{html.escape(title)}</div>")
    for text, mask, label, entropy in zip(record.token_texts, record.loss_mask, record.labels, record.entropy):
        escaped = html.escape(text)
        if label:
            parts.append(f'<span class="rstar-{label}" title="{label}, H={entropy:.3f}" '
                         f'style="background:{LABEL_COLOURS[label]}">{escaped}</span>')
        elif not mask:
            parts.append(f'<span class="rstar-tool" style="background:{TOOL_TOKEN_COLOUR};color:#666">{escaped}</span>')
        else:
            parts.append(escaped)
    parts.append("</div>")
    return "".join(parts)


def legend_html() -> str:
    items = [f'<span style="background:{colour};padding:0 4px">{label}</span>'
             for label, colour in LABEL_COLOURS.items()]
    items.append(f'<span style="background:{TOOL_TOKEN_COLOUR};padding:0 4px;color:#666">tool output / forced</span>')
    return "<div>" + " ".join(items) + "</div>"
