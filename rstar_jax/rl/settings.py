"""`LossConfig`, the loss's settings, in a module that imports no jax.

It lives apart from `rstar_jax.rl.loss` (which re-exports it) so that a config is checked
(`python -m rstar_jax.config`) without importing jax: the config package validates by building this
dataclass, and its objective names are checked against `rstar_jax.rl.registry`, whose built-ins are
known by name without importing the modules that define them.
"""

from __future__ import annotations

import dataclasses

from rstar_jax.rl.registry import check_advantage_estimator, check_policy_loss


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # rStar2-Agent §2.2.1: epsilon_low
    clip_high: float = 0.28  # clip-higher epsilon_high
    dual_clip: float | None = None  # verl's clip_ratio_c (3.0); None disables
    log_ratio_clamp: float = 20.0
    entropy_coef: float = 0.0  # GRPO-RoC has no entropy bonus (and no KL term: grpo_loss takes one)
    # The objective by name (rstar_jax.rl.registry): the step's loss and the batch's advantages.
    policy_loss: str = "grpo"
    advantage_estimator: str = "grpo"

    def __post_init__(self):
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if self.entropy_coef < 0:
            raise ValueError(f"LossConfig.entropy_coef must be >= 0, got {self.entropy_coef}")
        # Unknown names fail here, when the settings are built, not at the first jitted step; the
        # check imports nothing (a built-in's module, and jax with it, loads at its first use).
        for field, check in (("policy_loss", check_policy_loss), ("advantage_estimator", check_advantage_estimator)):
            try:
                check(getattr(self, field))
            except ValueError as e:
                raise ValueError(f"LossConfig.{field}: {e}") from None

