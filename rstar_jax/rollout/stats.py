"""Rollout figures of one step (or one evaluation): the one place they are computed.

A trajectory is positive when its reward exceeds 0.5. Tool-error rates are errors / calls within
all, positive and negative trajectories; the paper's Fig. 4 tracks the positive one, which RoC
pushes down. A ratio without a denominator (no call in that class, no positive trajectory) is
absent, not 0: a step without tool calls has no error rate, and logging 0.0 would plot as a perfect one. A format violation is an answer-tag count other than one.
`rollout_stats` reads live `Trajectory` objects, `record_stats` the stored records
(`rstar_jax.rollout.records`) of the same trajectories; both give the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rstar_jax.rollout.trajectory import STOP_CONTEXT, STOP_REJECTED, Trajectory

CORRECT_THRESHOLD = 0.5


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def _summary(c: dict[str, np.ndarray]) -> dict[str, float]:
    positive = c["reward"] > CORRECT_THRESHOLD
    negative = ~positive
    calls, errors, lengths = c["n_tool_calls"], c["n_tool_errors"], c["response_length"]
    groups: dict[int, list[bool]] = {}
    for group, ok in zip(c["group_id"].tolist(), positive.tolist()):
        groups.setdefault(group, []).append(ok)
    summary = {
        "reward_mean": float(c["reward"].mean()),
        "pass_rate": float(positive.mean()),  # fraction of correct trajectories
        "group_solve_rate": _ratio(sum(any(g) for g in groups.values()), len(groups)),
        "num_trajectories": len(lengths),
        "num_groups": len(groups),
        "tool_calls_mean": float(calls.mean()),
        "tool_calls_mean_positive": _ratio(calls[positive].sum(), positive.sum()),
        "tool_calls_mean_negative": _ratio(calls[negative].sum(), negative.sum()),
        "tool_error_rate": _ratio(errors.sum(), calls.sum()),
        "tool_error_rate_positive": _ratio(errors[positive].sum(), calls[positive].sum()),
        "tool_error_rate_negative": _ratio(errors[negative].sum(), calls[negative].sum()),
        # Correct trajectories that contain a failed call (reached the answer despite it): what RoC
        # filters, counted per trajectory where the rates above count per call.
        "positive_with_tool_error": _ratio((errors[positive] > 0).sum(), positive.sum()),
        "format_violation_rate": float((c["n_answer_tags"] != 1).mean()),
        "turns_mean": float(c["n_turns"].mean()),
        "response_length_mean": float(lengths.mean()),  # model + tool tokens
        "response_length_max": int(lengths.max()),
        "sampled_tokens": int(c["num_sampled_tokens"].sum()),  # model tokens only
        "truncation_ratio": float(c["truncated"].mean()),
        # Turns the generators retracted under KV pressure and recomputed (SGLang's num_retractions).
        "retractions": int(c["n_retractions"].sum()),
        # Generator failures the trajectories survived, aborted turns they continued, and the
        # requests generators refused (those trajectories are truncated and scored 0).
        "failovers": int(c["n_failovers"].sum()),
        "abort_resumes": int(c["n_abort_resumes"].sum()),
        "rejected": int(c["rejected"].sum()),
        # Trajectories cut at a generator's context length before their response budget ran out.
        "context_truncated": int(c["context_truncated"].sum()),
    }
    return {name: value for name, value in summary.items() if value is not None}


def rollout_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The step's rollout figures (unprefixed names; the trainer logs them under `rollout/`)."""
    if not trajectories:
        raise ValueError("rollout_stats: no trajectories")
    return _summary({
        "reward": np.asarray([t.reward for t in trajectories], np.float64),
        "group_id": np.asarray([t.group_id for t in trajectories]),
        "n_tool_calls": np.asarray([t.n_tool_calls for t in trajectories]),
        "n_tool_errors": np.asarray([t.n_tool_errors for t in trajectories]),
        "n_answer_tags": np.asarray([t.n_answer_tags for t in trajectories]),
        "n_turns": np.asarray([t.n_turns for t in trajectories]),
        "response_length": np.asarray([len(t.response_ids) for t in trajectories]),
        "num_sampled_tokens": np.asarray([t.num_sampled_tokens for t in trajectories]),
        "truncated": np.asarray([t.truncated for t in trajectories], bool),
        "n_retractions": np.asarray([t.n_retractions for t in trajectories]),
        "n_failovers": np.asarray([t.n_failovers for t in trajectories]),
        "n_abort_resumes": np.asarray([t.n_abort_resumes for t in trajectories]),
        "rejected": np.asarray([t.finish_reason == STOP_REJECTED for t in trajectories], bool),
        "context_truncated": np.asarray([t.finish_reason == STOP_CONTEXT for t in trajectories], bool),
    })


def record_stats(records: Sequence[Mapping]) -> dict[str, float]:
    """`rollout_stats` of stored trajectory records."""
    if not records:
        raise ValueError("record_stats: no records")
    columns = {name: np.asarray([r[name] for r in records]) for name in
               ("group_id", "n_tool_calls", "n_tool_errors", "n_answer_tags", "n_turns", "response_length",
                "num_sampled_tokens", "n_retractions")}
    columns["reward"] = np.asarray([r["reward"] for r in records], np.float64)
    columns["truncated"] = np.asarray([bool(r["truncated"]) for r in records])
    # Records written before these fields existed count none.
    for name in ("n_failovers", "n_abort_resumes"):
        columns[name] = np.asarray([int(r.get(name, 0)) for r in records])
    columns["rejected"] = np.asarray([r.get("finish_reason") == STOP_REJECTED for r in records], bool)
    columns["context_truncated"] = np.asarray([r.get("finish_reason") == STOP_CONTEXT for r in records], bool)
    return _summary(columns)
