"""One multi-turn trajectory as the rollout loop builds it and the trainer consumes it."""

from __future__ import annotations

import dataclasses

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
