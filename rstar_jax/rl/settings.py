"""`LossConfig`, the loss's settings, in a module that imports no jax.

It lives apart from `rstar_jax.rl.loss` (which re-exports it) so that a config is checked
(`python -m rstar_jax.config`) without importing jax: the config package validates by building this
dataclass, and its objective names are checked against `rstar_jax.rl.registry`, whose built-ins are
known by name without importing the modules that define them.
"""

from __future__ import annotations

import dataclasses

from rstar_jax.rl.registry import check_advantage_estimator, check_policy_loss


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def check_objective(*, loss_agg_mode="token-mean", loss_scale_factor=None, ratio_level="token", dual_clip=None,
                    rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                    rollout_rs_threshold_lower=None) -> None:
    """Refuses an objective `grpo_loss` cannot compute, with a ValueError that starts with the
    argument's name (`LossConfig` prefixes its class, so configs name their own field)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if loss_scale_factor is not None and not loss_scale_factor > 0:
        raise ValueError(f"loss_scale_factor must be > 0 (or None: the padded width), got {loss_scale_factor}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if ratio_level == "sequence":  # GSPO, as verl has it
        if loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(f"ratio_level 'sequence' (GSPO) aggregates 'seq-mean-token-mean', got loss_agg_mode "
                             f"{loss_agg_mode!r}")
        if dual_clip is not None:
            raise ValueError(f"ratio_level 'sequence' (GSPO) has no dual-clip: set dual_clip to None, got {dual_clip}")
    if rollout_is is not None:
        if rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be None or one of {IS_LEVELS}, got {rollout_is!r}")
        if rollout_is_threshold is None or not rollout_is_threshold > 0:
            raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    if rollout_rs is not None:
        if rollout_rs not in RS_LEVELS:
            raise ValueError(f"rollout_rs must be None or one of {RS_LEVELS}, got {rollout_rs!r}")
        if rollout_rs_threshold is None or not rollout_rs_threshold > 0:
            raise ValueError(f"rollout_rs_threshold must be > 0 when rollout_rs is set, got {rollout_rs_threshold}")
        lower = rejection_lower_bound(rollout_rs_threshold, rollout_rs_threshold_lower)
        if not 0 <= lower <= rollout_rs_threshold:
            raise ValueError(f"rollout_rs_threshold_lower must be in [0, rollout_rs_threshold="
                             f"{rollout_rs_threshold}] (None: 1 / rollout_rs_threshold), got "
                             f"{rollout_rs_threshold_lower}")


def rejection_lower_bound(upper: float, lower: float | None) -> float:
    """The rejection band's lower end: None means 1 / upper (verl's default), 0 no lower bound."""
    return 1.0 / upper if lower is None else lower


OBJECTIVE_FIELDS = ("loss_agg_mode", "loss_scale_factor", "ratio_level", "rollout_is", "rollout_is_threshold",
                    "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The policy loss's settings; `grpo_policy_loss` passes each to `grpo_loss` (its docstring
    has the formulas). The defaults are the paper's objective: token-mean PPO-clip with clip-higher,
    no KL, no entropy bonus, no rollout correction."""

    clip_low: float = 0.2  # rStar2-Agent §2.2.1: epsilon_low
    clip_high: float = 0.28  # clip-higher epsilon_high
    dual_clip: float | None = None  # verl's clip_ratio_c (3.0); None disables
    log_ratio_clamp: float = 20.0
    entropy_coef: float = 0.0  # GRPO-RoC has no entropy bonus (and no KL term: grpo_loss takes one)
    # The objective by name (rstar_jax.rl.registry): the step's loss and the batch's advantages.
    policy_loss: str = "grpo"
    advantage_estimator: str = "grpo"
    # Aggregation, ratio level and rollout correction, with verl's names and semantics.
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's H; None: the padded width
    ratio_level: str = "token"  # "sequence": GSPO
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None

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
        try:
            check_objective(dual_clip=self.dual_clip, **self.objective())
        except ValueError as e:
            raise ValueError(f"LossConfig.{e}") from None
        # Unknown names fail here, when the settings are built, not at the first jitted step; the
        # check imports nothing (a built-in's module, and jax with it, loads at its first use).
        for field, check in (("policy_loss", check_policy_loss), ("advantage_estimator", check_advantage_estimator)):
            try:
                check(getattr(self, field))
            except ValueError as e:
                raise ValueError(f"LossConfig.{field}: {e}") from None

    def objective(self) -> dict:
        """The aggregation, ratio-level and rollout-correction keywords of `grpo_loss`."""
        return {name: getattr(self, name) for name in OBJECTIVE_FIELDS}
