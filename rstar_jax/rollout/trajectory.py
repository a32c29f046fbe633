"""One multi-turn trajectory as the rollout loop builds it and the trainer consumes it."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

# Why a trajectory ended.
STOP_NO_TOOL_CALL = "no_tool_call"  # the model answered (or stopped calling tools): the normal end
STOP_MAX_TURNS = "max_turns"
STOP_BUDGET = "budget"  # the shared response budget (model + tool tokens) ran out: truncated
STOP_ABORTED = "aborted"  # the generator aborted a turn more often than the loop resumes one
STOP_REJECTED = "rejected"  # the generator refused a request (a 4xx): truncated
# The context reached the generator's context length before the response budget ran out: truncated.
STOP_CONTEXT = "context_length"


@dataclasses.dataclass
class Trajectory:
    """Token-level record of one rollout.

    `response_ids` holds everything after the prompt: sampled tokens (loss_mask 1) and tool
    observations plus the forced `<reason>` of later turns (loss_mask 0). `sampler_logprobs` is
    aligned with `response_ids` (0.0 where loss_mask is 0).
    """

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    sampler_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)  # per response token
    reward: float = 0.0
    finish_reason: str = ""  # one of the STOP_* values
    truncated: bool = False
    group_id: int = 0
    sample_index: int = 0
    question: str = ""
    gold_answer: str = ""
    n_turns: int = 0  # assistant turns
    n_tool_calls: int = 0
    n_tool_errors: int = 0  # by execution status, not by substring
    n_answer_tags: int = 0  # closed <answer>...</answer> pairs
    tool_statuses: list[str] = dataclasses.field(default_factory=list)
    tool_seconds: float = 0.0  # wall time this trajectory waited on its tool calls (sandbox round trips)
    n_retractions: int = 0  # times KV-cache pressure made a generator retract and recompute one of its turns
    n_failovers: int = 0  # times its generator failed and it resumed on another from its last complete turn
    n_abort_resumes: int = 0  # aborted turns continued from their partial output (partial rollout)
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def num_sampled_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def policy_version(self) -> int:
        """Oldest policy version among the sampled tokens (the staleness that matters)."""
        sampled = [v for v, m in zip(self.policy_versions, self.loss_mask) if m]
        return min(sampled) if sampled else 0

    def check(self) -> None:
        """Raise if the per-token lists disagree in length."""
        n = len(self.response_ids)
        for name in ("loss_mask", "sampler_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries, response_ids {n}")

    def arrays(self) -> dict[str, np.ndarray]:
        self.check()
        return {
            "prompt_ids": np.asarray(self.prompt_ids, np.int32),
            "response_ids": np.asarray(self.response_ids, np.int32),
            "loss_mask": np.asarray(self.loss_mask, np.int32),
            "sampler_logprobs": np.asarray(self.sampler_logprobs, np.float32),
        }


# -- trajectories crossing processes ---------------------------------------------------------------
# `pack_trajectories` turns trajectories into flat numpy arrays plus one small JSON-able value (for
# `rstar_jax.parallel.multihost.allgather_arrays`); `unpack_trajectories` rebuilds equal ones, field
# for field. Per-token lists travel as flat arrays with per-trajectory lengths: token ids in the
# narrowest integer type that holds them (int32 for a real vocabulary), log-probs as float32 when
# every value is a float32 (the generators' are) and float64 otherwise, the loss mask and policy
# versions run-length coded (a few runs per turn). Prompts, questions and gold answers are shared by
# a group's trajectories: each distinct one travels once. `extra["model_text"]` (the decoded
# sampled text, which the writer's rollout records need) travels as UTF-8 bytes. Every other field
# goes into one short JSON record per trajectory, so a field added to Trajectory travels too.

_PROMPT = "prompt_ids"
_TOKEN_FIELDS = ("response_ids",)
_RUN_FIELDS = ("loss_mask", "policy_versions")
_FLOAT_FIELDS = ("sampler_logprobs",)
_TABLE_FIELDS = ("question", "gold_answer")
_TEXT_KEY = "model_text"
_PACKED = {_PROMPT, *_TOKEN_FIELDS, *_RUN_FIELDS, *_FLOAT_FIELDS, *_TABLE_FIELDS, "extra"}


def _narrow(a: np.ndarray) -> np.ndarray:
    """Integer array `a` in the smallest integer type that holds its values exactly."""
    if a.size == 0:
        return a.astype(np.uint8)
    lo, hi = int(a.min()), int(a.max())
    for dtype in (np.uint8, np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return a.astype(dtype)
    return a.astype(np.int64)


def _flat(lists: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The concatenation of `lists` as one array, and their lengths."""
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype, count=int(lengths.sum()))
    return flat, _narrow(lengths)


def _split(flat: list, lengths: np.ndarray) -> list[list]:
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _table(values: list, key=lambda v: v) -> tuple[list, np.ndarray]:
    """The distinct `values` in first-seen order, and each value's index among them."""
    index: dict = {}
    rows = [index.setdefault(key(v), len(index)) for v in values]
    distinct = [None] * len(index)
    for v, i in zip(values, rows):
        distinct[i] = v
    return distinct, _narrow(np.asarray(rows, np.int64))


def pack_trajectories(trajectories: list[Trajectory]) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of `trajectories` for `allgather_arrays`; `unpack_trajectories` inverts it."""
    arrays: dict[str, np.ndarray] = {}
    prompts, arrays[f"{_PROMPT}.index"] = _table([t.prompt_ids for t in trajectories], key=tuple)
    flat, arrays[f"{_PROMPT}.len"] = _flat(prompts, np.int64)
    arrays[_PROMPT] = _narrow(flat)
    for name in _TOKEN_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], np.int64)
        arrays[name] = _narrow(flat)
    for name in _RUN_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], np.int64)
        starts = np.flatnonzero(np.diff(flat)) + 1 if flat.size else np.zeros(0, np.int64)
        starts = np.concatenate([np.zeros(min(flat.size, 1), np.int64), starts])
        arrays[f"{name}.values"] = _narrow(flat[starts])
        arrays[f"{name}.runs"] = _narrow(np.diff(np.append(starts, flat.size)))
    for name in _FLOAT_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], np.float64)
        single = flat.astype(np.float32)
        exact = np.array_equal(single.astype(np.float64), flat, equal_nan=True)
        arrays[name] = single if exact else flat
    tables = {}
    for name in _TABLE_FIELDS:
        tables[name], arrays[f"{name}.index"] = _table([getattr(t, name) for t in trajectories])
    texts, at, extras = [], [], []
    for t in trajectories:
        keys = list(t.extra)
        if isinstance(t.extra.get(_TEXT_KEY), str):
            texts.append(t.extra[_TEXT_KEY].encode("utf-8", "surrogatepass"))
            at.append(keys.index(_TEXT_KEY))
            extras.append({k: v for k, v in t.extra.items() if k != _TEXT_KEY})
        else:
            texts.append(b"")
            at.append(-1)
            extras.append(t.extra)
    arrays[_TEXT_KEY] = np.frombuffer(b"".join(texts), np.uint8)
    arrays[f"{_TEXT_KEY}.len"] = _narrow(np.asarray([len(b) for b in texts], np.int64))
    arrays[f"{_TEXT_KEY}.at"] = _narrow(np.asarray(at, np.int64))
    fields = [f.name for f in dataclasses.fields(Trajectory) if f.name not in _PACKED]
    records = [[getattr(t, name) for name in fields] + [extra] for t, extra in zip(trajectories, extras)]
    return arrays, {"fields": fields, "tables": tables, "records": records}


def unpack_trajectories(arrays: dict[str, np.ndarray], meta: dict) -> list[Trajectory]:
    """The trajectories `pack_trajectories` packed, equal to them field for field."""
    fields = [f.name for f in dataclasses.fields(Trajectory) if f.name not in _PACKED]
    if meta["fields"] != fields:
        raise ValueError(f"packed trajectories have fields {meta['fields']}, this Trajectory {fields}")
    columns: dict[str, list] = {}
    prompts = _split(arrays[_PROMPT].tolist(), arrays[f"{_PROMPT}.len"])
    columns[_PROMPT] = [list(prompts[i]) for i in arrays[f"{_PROMPT}.index"].tolist()]
    for name in (*_TOKEN_FIELDS, *_FLOAT_FIELDS):
        columns[name] = _split(arrays[name].tolist(), arrays[f"{name}.len"])
    for name in _RUN_FIELDS:
        flat = np.repeat(arrays[f"{name}.values"], arrays[f"{name}.runs"].astype(np.int64))
        columns[name] = _split(flat.tolist(), arrays[f"{name}.len"])
    for name in _TABLE_FIELDS:
        table = meta["tables"][name]
        columns[name] = [table[i] for i in arrays[f"{name}.index"].tolist()]
    raw = arrays[_TEXT_KEY].tobytes()
    ends = np.cumsum(arrays[f"{_TEXT_KEY}.len"], dtype=np.int64).tolist()
    trajectories = []
    for i, (record, at, start, end) in enumerate(zip(meta["records"], arrays[f"{_TEXT_KEY}.at"].tolist(),
                                                     [0, *ends[:-1]], ends)):
        extra = record[-1]
        if at >= 0:
            items = list(extra.items())
            items.insert(at, (_TEXT_KEY, raw[start:end].decode("utf-8", "surrogatepass")))
            extra = dict(items)
        values = dict(zip(fields, record[:-1]), extra=extra)
        values.update({name: column[i] for name, column in columns.items()})
        trajectories.append(Trajectory(**values))
    return trajectories
