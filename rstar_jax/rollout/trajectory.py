"""One multi-turn trajectory as the rollout loop builds it and the trainer consumes it."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

import numpy as np

from rstar_jax.rollout.tokens import TokenArray, _as_array, _holds, _wider

# Why a trajectory ended.
STOP_NO_TOOL_CALL = "no_tool_call"  # the model answered (or stopped calling tools): the normal end
STOP_MAX_TURNS = "max_turns"
STOP_BUDGET = "budget"  # the shared response budget (model + tool tokens) ran out: truncated
STOP_ABORTED = "aborted"  # the generator aborted a turn more often than the loop resumes one
STOP_REJECTED = "rejected"  # the generator refused a request (a 4xx): truncated
# The context reached the generator's context length before the response budget ran out: truncated.
STOP_CONTEXT = "context_length"

# How the per-token fields are held (`Trajectory.begin`, `LoopConfig.token_buffers`):
# "array": TokenArrays (rstar_jax.rollout.tokens) of these dtypes, widened only for values they
#   cannot hold exactly: 13 bytes a token;
# "list": Python lists, as before TokenArrays (the baseline benchmarks/host_rollout.py measures).
TOKEN_BUFFERS = ("array", "list")
TOKEN_DTYPES = {"prompt_ids": np.int32, "response_ids": np.int32, "loss_mask": np.int8,
                "sampler_logprobs": np.float32, "policy_versions": np.int32}
TOKEN_FIELDS = tuple(TOKEN_DTYPES)


@dataclasses.dataclass
class Trajectory:
    """Token-level record of one rollout.

    `response_ids` holds everything after the prompt: sampled tokens (loss_mask 1) and tool
    observations plus the forced `<reason>` of later turns (loss_mask 0). `sampler_logprobs` is
    aligned with `response_ids` (0.0 where loss_mask is 0).

    The per-token fields (`TOKEN_FIELDS`) are sequences: TokenArrays where the rollout loop and
    `unpack_trajectories` build them (typed numpy buffers that read, compare and extend like lists),
    or whatever lists a caller passes. `extend_sampled`, `extend_observation` and `truncate_response`
    grow and cut them in either form.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int] = dataclasses.field(default_factory=list)
    loss_mask: Sequence[int] = dataclasses.field(default_factory=list)
    sampler_logprobs: Sequence[float] = dataclasses.field(default_factory=list)
    policy_versions: Sequence[int] = dataclasses.field(default_factory=list)  # per response token
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

    @classmethod
    def begin(cls, prompt_ids: Sequence[int], *, buffers: str = "array", **fields: Any) -> "Trajectory":
        """A trajectory with no response yet, its per-token fields held as `buffers` says
        (`TOKEN_BUFFERS`): empty TokenArrays of `TOKEN_DTYPES` ("array") or lists ("list")."""
        if buffers == "array":
            tokens = {name: TokenArray((), dtype) for name, dtype in TOKEN_DTYPES.items()}
            tokens["prompt_ids"] = TokenArray(prompt_ids, TOKEN_DTYPES["prompt_ids"])
        elif buffers == "list":
            tokens = {name: [] for name in TOKEN_FIELDS}
            tokens["prompt_ids"] = list(prompt_ids)
        else:
            raise ValueError(f"Trajectory.begin: buffers must be one of {TOKEN_BUFFERS}, got {buffers!r}")
        return cls(**tokens, **fields)

    # -- growing the response (the rollout loop) -------------------------------------------------
    def extend_sampled(self, token_ids: Sequence[int], logprobs: Sequence[float],
                       versions: Sequence[int] | int) -> None:
        """Appends tokens the policy sampled (loss mask 1) with their log-probs and the weight version
        of each (one int: every token's)."""
        n = len(token_ids)
        if isinstance(self.response_ids, TokenArray):
            self.response_ids.extend(token_ids)
            self.loss_mask.fill(1, n)
            self.sampler_logprobs.extend(logprobs)
            if isinstance(versions, int):
                self.policy_versions.fill(versions, n)
            else:
                self.policy_versions.extend(versions)
            return
        self.response_ids += list(token_ids)
        self.loss_mask += [1] * n
        self.sampler_logprobs += [float(x) for x in logprobs]
        self.policy_versions += [versions] * n if isinstance(versions, int) else list(versions)

    def extend_observation(self, token_ids: Sequence[int]) -> None:
        """Appends tokens the policy did not sample (a tool observation, the next turn's forced
        prefix): loss mask 0, log-prob 0.0, version -1."""
        n = len(token_ids)
        if isinstance(self.response_ids, TokenArray):
            self.response_ids.extend(token_ids)
            self.loss_mask.fill(0, n)
            self.sampler_logprobs.fill(0.0, n)
            self.policy_versions.fill(-1, n)
            return
        self.response_ids += list(token_ids)
        self.loss_mask += [0] * n
        self.sampler_logprobs += [0.0] * n
        self.policy_versions += [-1] * n

    def truncate_response(self, length: int) -> None:
        """Cuts every response-aligned field to its first `length` tokens."""
        for name in TOKEN_FIELDS[1:]:
            del getattr(self, name)[length:]

    def trim(self) -> None:
        """Drops the spare capacity of TokenArray fields (once the trajectory stops growing)."""
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if isinstance(value, TokenArray):
                value.trim()

    # -- reading -----------------------------------------------------------------------------------
    @property
    def num_sampled_tokens(self) -> int:
        mask = np.asarray(self.loss_mask)
        return int(mask.sum(dtype=np.int64)) if mask.size else 0

    @property
    def policy_version(self) -> int:
        """Oldest policy version among the sampled tokens (the staleness that matters)."""
        n = min(len(self.policy_versions), len(self.loss_mask))
        if not n:
            return 0
        versions = np.asarray(self.policy_versions)[:n]
        sampled = versions[np.asarray(self.loss_mask)[:n] != 0]
        return int(sampled.min()) if sampled.size else 0

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

    def token_bytes(self) -> int:
        """Bytes the per-token fields hold: TokenArray buffers (spare capacity included), or a list's
        pointers and the number objects it alone holds (small ints and repeated floats are shared)."""
        total = 0
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if isinstance(value, TokenArray):
                total += sys.getsizeof(value) + _ARRAY_HEADER + value.nbytes
            else:
                total += _list_bytes(value)
        return total


_ARRAY_HEADER = sys.getsizeof(np.empty(0))


def _list_bytes(values) -> int:
    total, seen = sys.getsizeof(values), set()
    for v in values:
        if id(v) in seen or (type(v) is int and -5 <= v <= 256):
            continue
        seen.add(id(v))
        total += sys.getsizeof(v)
    return total


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


def _flat(seqs: list, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The concatenation of `seqs` (TokenArrays are read in place, lists converted) as one array of
    integers (`kind` "i") or floats ("f"), and their lengths."""
    lengths = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
    parts = [_as_array(s) for s in seqs if len(s)]
    default = np.int64 if kind == "i" else np.float64
    if not parts:
        return np.zeros(0, default), _narrow(lengths)
    dtype = np.result_type(*(p.dtype for p in parts))
    if dtype.kind not in ("f" if kind == "f" else "iu"):
        dtype = np.dtype(default)
    return np.concatenate(parts, dtype=dtype, casting="unsafe"), _narrow(lengths)


def _split(flat: np.ndarray, lengths: np.ndarray, dtype) -> list[TokenArray]:
    """`flat` cut into TokenArrays of `lengths`, held as `dtype` (widened where it cannot hold them);
    each owns a disjoint part of one copy of `flat`."""
    flat = flat.astype(dtype if _holds(np.dtype(dtype), flat) else _wider(np.dtype(dtype), flat))
    ends = np.cumsum(lengths, dtype=np.int64)
    return [TokenArray._wrap(part) for part in np.split(flat, ends[:-1])] if len(ends) else []


def _prompt_key(prompt) -> bytes:
    return _as_array(prompt).astype(np.int64).tobytes()


def _table(values: list, key=lambda v: v) -> tuple[list, np.ndarray]:
    """The distinct `values` in first-seen order, and each value's index among them."""
    index: dict = {}
    rows = [index.setdefault(key(v), len(index)) for v in values]
    distinct = [None] * len(index)
    for v, i in zip(values, rows):
        distinct[i] = v
    return distinct, _narrow(np.asarray(rows, np.int64))


def pack_trajectories(trajectories: list[Trajectory]) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of `trajectories` for `allgather_arrays`; `unpack_trajectories` inverts it.
    TokenArray fields are read in place (no conversion); list fields are converted."""
    arrays: dict[str, np.ndarray] = {}
    prompts, arrays[f"{_PROMPT}.index"] = _table([t.prompt_ids for t in trajectories], key=_prompt_key)
    flat, arrays[f"{_PROMPT}.len"] = _flat(prompts, "i")
    arrays[_PROMPT] = _narrow(flat)
    for name in _TOKEN_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], "i")
        arrays[name] = _narrow(flat)
    for name in _RUN_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], "i")
        starts = np.flatnonzero(np.diff(flat)) + 1 if flat.size else np.zeros(0, np.int64)
        starts = np.concatenate([np.zeros(min(flat.size, 1), np.int64), starts])
        arrays[f"{name}.values"] = _narrow(flat[starts])
        arrays[f"{name}.runs"] = _narrow(np.diff(np.append(starts, flat.size)))
    for name in _FLOAT_FIELDS:
        flat, arrays[f"{name}.len"] = _flat([getattr(t, name) for t in trajectories], "f")
        single = flat.astype(np.float32)
        exact = np.array_equal(single.astype(flat.dtype), flat, equal_nan=True)
        arrays[name] = single if exact else flat.astype(np.float64)
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
    """The trajectories `pack_trajectories` packed, equal to them field for field; their per-token
    fields are TokenArrays of `TOKEN_DTYPES` (wider where the values need it)."""
    fields = [f.name for f in dataclasses.fields(Trajectory) if f.name not in _PACKED]
    if meta["fields"] != fields:
        raise ValueError(f"packed trajectories have fields {meta['fields']}, this Trajectory {fields}")
    columns: dict[str, list] = {}
    prompts = _split(arrays[_PROMPT], arrays[f"{_PROMPT}.len"], TOKEN_DTYPES[_PROMPT])
    columns[_PROMPT] = [prompts[i].copy() for i in arrays[f"{_PROMPT}.index"].tolist()]
    for name in (*_TOKEN_FIELDS, *_FLOAT_FIELDS):
        columns[name] = _split(arrays[name], arrays[f"{name}.len"], TOKEN_DTYPES[name])
    for name in _RUN_FIELDS:
        flat = np.repeat(arrays[f"{name}.values"], arrays[f"{name}.runs"].astype(np.int64))
        columns[name] = _split(flat, arrays[f"{name}.len"], TOKEN_DTYPES[name])
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
