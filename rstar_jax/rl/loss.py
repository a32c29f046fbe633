"""GRPO-RoC policy loss: PPO clipped surrogate with clip-higher, optional dual-clip, no KL.

`grpo_loss` returns the *sum* of per-token losses and the token count instead of a mean, so the
token-level mean of rStar2-Agent's Eq. 6 (one sum over every kept token, divided by the number of
kept tokens in the global batch) stays exact under micro-batching, gradient accumulation and
packing: callers add numerators and denominators across micro-batches and divide once.

Metrics are returned in the same additive form (sums, counts, maxima, minima);
`finalize_metrics` turns accumulated metrics into means and fractions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rstar_jax.rl.registry import register_policy_loss
from rstar_jax.rl.settings import LossConfig  # re-exported: defined apart so configs are checked without jax


MAX_METRICS = ("ratio_max", "drift_max")
MIN_METRICS = ("ratio_min",)


@jax.named_scope("grpo_loss")
def grpo_loss(logprobs, old_logprobs, advantages, loss_mask, *, clip_low=0.2, clip_high=0.28, dual_clip=None,
              log_ratio_clamp=20.0, ref_logprobs=None, kl_coef=0.0, entropy=None, entropy_coef=0.0,
              sampler_logprobs=None):
    """Token-level PPO-clip loss. All inputs [..., T]; `advantages` per token ([..., T], or
    broadcastable to it) or per sequence ([...], one value per row, as `group_advantages` returns).

    Returns (loss_sum, token_count, metrics): the gradient of loss_sum / total_token_count is the
    exact token-mean objective.
    """
    mask = loss_mask.astype(jnp.float32)
    on = mask > 0
    advantages = jnp.asarray(advantages)
    if advantages.ndim == logprobs.ndim - 1:  # one per sequence: the same for each of its tokens
        advantages = advantages[..., None]
    try:
        advantages = jnp.broadcast_to(advantages, logprobs.shape).astype(jnp.float32)
    except ValueError:
        raise ValueError(f"grpo_loss: advantages of shape {advantages.shape} fit neither logprobs' "
                         f"{logprobs.shape} (per token) nor {logprobs.shape[:-1]} (per sequence)") from None
    # Masked positions may hold anything (padding, -inf): zero them before exp.
    log_ratio = jnp.where(on, logprobs - old_logprobs, 0.0)
    log_ratio = jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    clip_high_hit = on & (advantages > 0) & (ratio > 1.0 + clip_high)
    clip_low_hit = on & (advantages < 0) & (ratio < 1.0 - clip_low)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_hit = on & (advantages < 0) & (per_token > bound)
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, bound), per_token)
    else:
        dual_hit = jnp.zeros_like(on)
    pg_loss = per_token
    kl = jnp.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef:
        # k3 estimator of KL(pi || ref), as verl's "low_var_kl", clamped for stability.
        delta = jnp.clip(jnp.where(on, ref_logprobs - logprobs, 0.0), -20.0, 20.0)
        kl = jnp.clip(jnp.exp(delta) - delta - 1.0, -10.0, 10.0)
        per_token = per_token + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss_sum = jnp.sum(jnp.where(on, per_token, 0.0))
    token_count = jnp.sum(mask)
    big = jnp.float32(jnp.finfo(jnp.float32).max)
    metrics = {
        "token_count": token_count,
        "pg_loss_sum": jnp.sum(jnp.where(on, pg_loss, 0.0)),
        "clip_low_count": jnp.sum(clip_low_hit.astype(jnp.float32)),
        "clip_high_count": jnp.sum(clip_high_hit.astype(jnp.float32)),
        "dual_clip_count": jnp.sum(dual_hit.astype(jnp.float32)),
        "ratio_sum": jnp.sum(jnp.where(on, ratio, 0.0)),
        "ratio_max": jnp.max(jnp.where(on, ratio, -big)),
        "ratio_min": jnp.min(jnp.where(on, ratio, big)),
        "kl_sum": jnp.sum(jnp.where(on, kl, 0.0)),
        "entropy_sum": jnp.sum(jnp.where(on, entropy, 0.0)) if entropy is not None else jnp.float32(0.0),
    }
    if sampler_logprobs is not None:
        drift = jnp.where(on, jnp.abs(logprobs - sampler_logprobs), 0.0)
        metrics["drift_abs_sum"] = jnp.sum(drift)
        metrics["drift_max"] = jnp.max(drift)
    else:
        metrics["drift_abs_sum"] = jnp.float32(0.0)
        metrics["drift_max"] = jnp.float32(0.0)
    return loss_sum, token_count, jax.lax.stop_gradient(metrics)


@register_policy_loss("grpo")
def grpo_policy_loss(settings: LossConfig, logprobs, old_logprobs, advantages, loss_mask, *, entropy=None,
                     sampler_logprobs=None, **unused_extras):
    """`grpo_loss` with its coefficients from `settings`: the registered default, "grpo" as the
    objective is named in rStar2-Agent (GRPO-RoC) and in tunix's registry."""
    return grpo_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low=settings.clip_low,
                     clip_high=settings.clip_high, dual_clip=settings.dual_clip,
                     log_ratio_clamp=settings.log_ratio_clamp, entropy=entropy,
                     entropy_coef=settings.entropy_coef, sampler_logprobs=sampler_logprobs)


def empty_metrics(like: dict) -> dict:
    """The identity of `combine_metrics` for metrics shaped like `like` (arrays or ShapeDtypeStructs):
    zero sums and counts, maxima at -max and minima at +max float32."""
    big = jnp.finfo(jnp.float32).max
    out = {}
    for key, value in like.items():
        fill = -big if key in MAX_METRICS else big if key in MIN_METRICS else 0
        out[key] = jnp.full(value.shape, fill, value.dtype)
    return out


def combine_metrics(a: dict, b: dict) -> dict:
    """Merges two additive metric dicts (as produced by `grpo_loss`)."""
    out = {}
    for key in a:
        if key in MAX_METRICS:
            out[key] = jnp.maximum(a[key], b[key])
        elif key in MIN_METRICS:
            out[key] = jnp.minimum(a[key], b[key])
        else:
            out[key] = a[key] + b[key]
    return out


def finalize_metrics(metrics: dict) -> dict:
    """Means and fractions from accumulated sums (host floats)."""
    m = {k: float(v) for k, v in metrics.items()}
    n = max(m["token_count"], 1.0)
    out = {
        "loss/pg": m["pg_loss_sum"] / n,
        "loss/tokens": m["token_count"],
        "clip/low_frac": m["clip_low_count"] / n,
        "clip/high_frac": m["clip_high_count"] / n,
        "clip/dual_frac": m["dual_clip_count"] / n,
        "ratio/mean": m["ratio_sum"] / n,
        "ratio/max": m["ratio_max"] if m["token_count"] else 1.0,
        "ratio/min": m["ratio_min"] if m["token_count"] else 1.0,
        "kl/mean": m["kl_sum"] / n,
        "entropy/mean": m["entropy_sum"] / n,
        "drift/logprob_abs_mean": m["drift_abs_sum"] / n,
        "drift/logprob_abs_max": m["drift_max"],
    }
    return out
