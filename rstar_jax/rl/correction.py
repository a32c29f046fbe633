"""Rollout correction: the sampler–trainer mismatch, weighted or rejected inside the loss.

The generator (SGLang or the JaxEngine, bf16, its own kernels) samples from a policy μ that is not
exactly the trainer's π_old, and asynchronous training makes them further apart. In the decoupled
reading of PPO (verl's "Rollout Correction", `rollout_corr_helper.py`), the clipped ratio stays
π_θ / π_old and the behaviour ratio ρ = π_old / μ corrects for who sampled:

- importance sampling (`rollout_is`): the per-token loss is multiplied by min(ρ, C), gradient
  stopped, with ρ per token (`"token"`) or the sequence's product (`"sequence"`);
- rejection (`rollout_rs`): tokens (`"token"`) or whole sequences (`"sequence"`: the product,
  `"geometric"`: the geometric mean) whose ρ leaves [lower, upper] leave the loss, its numerator
  and its denominator alike.

Both are computed from the original loss mask; log-ratios are clamped to ±20 before exp, as verl's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rstar_jax.rl.sequences import segment_totals
from rstar_jax.rl.settings import rejection_lower_bound

SAFETY_BOUND = 20.0  # exp(±20): verl's bound on exponentiated log-ratios


def behaviour_log_ratio(old_logprobs, sampler_logprobs, mask):
    """log ρ = log π_old − log μ per token, 0 off the mask (masked positions may hold anything)."""
    return jnp.where(mask > 0, old_logprobs - sampler_logprobs, 0.0)


def _level_log_ratio(log_ratio, mask, segments, level):
    if level == "token":
        return log_ratio
    total = segment_totals(log_ratio, segments)
    if level == "sequence":
        return total
    return total / jnp.maximum(segment_totals(mask, segments), 1.0)  # geometric mean


def importance_weights(log_ratio, mask, segments, level, threshold):
    """(min(ρ, C) per token with the gradient stopped, ρ before truncation); both 0 off the mask."""
    raw = jnp.exp(jnp.clip(_level_log_ratio(log_ratio, mask, segments, level), -SAFETY_BOUND, SAFETY_BOUND))
    raw = jnp.where(mask > 0, raw, 0.0)
    return jax.lax.stop_gradient(jnp.minimum(raw, threshold)), jax.lax.stop_gradient(raw)


def rejection_mask(log_ratio, mask, segments, level, upper, lower):
    """1.0 where ρ (at `level`) lies in [lower, upper], else 0.0; multiply it into the loss mask."""
    rho = jnp.exp(jnp.clip(_level_log_ratio(log_ratio, mask, segments, level), -SAFETY_BOUND, SAFETY_BOUND))
    return ((rho >= rejection_lower_bound(upper, lower)) & (rho <= upper)).astype(jnp.float32)


def mismatch_sums(log_ratio, mask):
    """Additive KL(μ ‖ π_old) estimates over the masked tokens: k1 = Σ −log ρ and
    k3 = Σ (ρ − log ρ − 1) (Schulman's low-variance estimator), as verl's `kl` and `k3_kl`."""
    on = mask > 0
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    # expm1: for the small log-ratios of a near-on-policy batch, exp(x) - x - 1 in float32 is all rounding.
    return (jnp.sum(jnp.where(on, -log_ratio, 0.0)),
            jnp.sum(jnp.where(on, jnp.expm1(safe) - safe, 0.0)))
