"""From rewarded trajectories to a training batch: RoC -> advantages -> micro-batches (host side).

This is the part of an RL step between rollout and the jitted update (rStar2-Agent §1.2 steps 4-7):
all-equal groups are dropped without refill, RoC keeps G rollouts per remaining group, advantages
are computed over the kept rollouts only, and the kept trajectories are laid into fixed-shape
micro-batches. A step whose groups were all dropped yields no batch and is skipped by the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstar_jax.agent.stats import release_counts
from rstar_jax.rl.registry import get_advantage_estimator
from rstar_jax.rl.roc import RocConfig, RocResult, paper_penalty, release_penalty, resample_on_correct
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
# Re-exported: defined apart so configs are checked without jax.
from rstar_jax.train.settings import BatchConfig, row_length_for  # noqa: F401


@dataclasses.dataclass
class PreparedBatch:
    batch: dict[str, np.ndarray] | None  # [M, rows, row_length] arrays, None when every group was dropped
    kept: list[Trajectory]
    advantages: np.ndarray  # per kept trajectory
    roc: RocResult

    @property
    def skipped(self) -> bool:
        return self.batch is None


def penalties_for(trajectories: Sequence[Trajectory], variant: str, decode=None) -> np.ndarray:
    """RoC penalties: the paper's from execution statistics, or the release's from decoded text."""
    if variant == "paper":
        return paper_penalty([t.n_tool_calls for t in trajectories], [t.n_tool_errors for t in trajectories],
                             [t.n_answer_tags for t in trajectories], [max(t.n_turns, 1) for t in trajectories])
    if decode is None:
        raise ValueError("penalties_for: the release variant needs `decode(ids) -> text` (special tokens kept)")
    counts = [release_counts(decode(t.response_ids)) for t in trajectories]
    return release_penalty(**{key: [c[key] for c in counts] for key in counts[0]}) if counts else np.zeros(0)


def prepare_batch(trajectories: Sequence[Trajectory], roc_config: RocConfig, batch_config: BatchConfig,
                  *, seed, decode=None, advantage_estimator: str = "grpo") -> PreparedBatch:
    """RoC (its draw seeded by `seed`, as `resample_on_correct`), then the advantages of the kept
    rollouts by the estimator registered as `advantage_estimator` (`LossConfig.advantage_estimator`),
    then fixed-shape micro-batches."""
    if not trajectories:
        raise ValueError("prepare_batch: no trajectories")
    for i, t in enumerate(trajectories):
        t.check()
        if not t.response_ids:
            raise ValueError(f"prepare_batch: trajectory {i} (group {t.group_id}) has an empty response")
    rewards = np.asarray([t.reward for t in trajectories], np.float64)
    groups = np.asarray([t.group_id for t in trajectories])
    roc = resample_on_correct(rewards, groups, penalties_for(trajectories, roc_config.variant, decode), roc_config,
                              seed=seed)
    if len(roc.kept_indices) == 0:
        return PreparedBatch(None, [], np.zeros(0, np.float32), roc)
    kept = [trajectories[i] for i in roc.kept_indices]
    advantages = get_advantage_estimator(advantage_estimator)(rewards[roc.kept_indices], groups[roc.kept_indices])
    sequences = [
        TrainingSequence(
            prompt_ids=t.prompt_ids, response_ids=t.response_ids, loss_mask=t.loss_mask, advantage=float(a),
            old_logprobs=t.sampler_logprobs if batch_config.use_sampler_logprobs else None,
            sampler_logprobs=t.sampler_logprobs)
        for t, a in zip(kept, advantages)
    ]
    batch = make_micro_batches(sequences, rows=batch_config.rows, row_length=batch_config.row_length,
                               packed=batch_config.packed, num_micro_batches=batch_config.num_micro_batches)
    return PreparedBatch(batch, kept, advantages, roc)
