"""Group-relative advantages, computed over the rollouts RoC kept (rStar2-Agent Eq. 7)."""

from __future__ import annotations

import numpy as np

from rstar_jax.rl.registry import register_advantage_estimator


@register_advantage_estimator("grpo")
def group_advantages(rewards, group_ids, epsilon: float = 1e-6) -> np.ndarray:
    """(r − mean) / (unbiased std + epsilon) within each group; a group of one gets 0."""
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"group_advantages: rewards {rewards.shape} and group_ids {group_ids.shape} must be equal 1-D")
    out = np.zeros_like(rewards)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        if len(idx) < 2:
            continue
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std(ddof=1) + epsilon)
    return out.astype(np.float32)
