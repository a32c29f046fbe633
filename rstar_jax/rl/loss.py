"""GRPO-RoC policy loss: PPO clipped surrogate with clip-higher, optional dual-clip, no KL.

`grpo_loss` returns the *sum* of per-token losses and the token count instead of a mean, so the
token-level mean of rStar2-Agent's Eq. 6 (one sum over every kept token, divided by the number of
kept tokens in the global batch) stays exact under micro-batching, gradient accumulation and
packing: callers add numerators and denominators across micro-batches and divide once.

Metrics are returned in the same additive form (sums, counts, maxima, minima): `combine_metrics`
merges two micro-batches' (`empty_metrics` is its identity, for a `lax.scan` carry) and
`finalize_metrics` turns the accumulated ones into means and fractions on the host.
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
    """Token-level PPO-clip loss (rStar2-Agent Eq. 6; verl's "vanilla" policy loss, token-mean).

    Args:
      logprobs: [..., T] log-probs of the taken tokens under the policy being trained.
      old_logprobs: [..., T] the same under the policy that produced the batch (π_old).
      advantages: per token ([..., T], or broadcastable to it) or per sequence ([...], one value
        per row, as `group_advantages` returns them); any other shape is refused.
      loss_mask: [..., T], nonzero on the tokens that count (the model's own tokens; not the
        prompt, tool output or padding). Masked positions may hold anything, even -inf.
      clip_low, clip_high: the ratio's clip range [1 - clip_low, 1 + clip_high] (clip-higher:
        DAPO's 0.2 / 0.28, the paper's).
      dual_clip: None, or c > 1: for negative advantages the loss is at most -A·c (verl's
        `clip_ratio_c`, 3.0 there).
      log_ratio_clamp: log(π/π_old) is clamped to ±this before exp, for stability.
      ref_logprobs, kl_coef: an optional k3 KL penalty to a reference policy (off in the recipe).
      entropy, entropy_coef: optional per-token entropies and a bonus coefficient (off in the
        recipe); given entropies are also reported.
      sampler_logprobs: optional [..., T] log-probs the generator reported, to measure how far
        the trainer's numbers drift from the sampler's.

    Returns:
      (loss_sum, token_count, metrics). loss_sum is the sum of the per-token losses over masked
      tokens, token_count the number of those tokens: the gradient of
      sum(loss_sum) / sum(token_count) over all micro-batches is the exact token-mean objective.
      Dividing by a token_count of 0 is the caller's to avoid (`jnp.maximum(total, 1)`: a batch
      without tokens then contributes a zero gradient). metrics, all fp32 scalars with the
      gradient stopped, additive across micro-batches (`combine_metrics`):
        token_count; pg_loss_sum (the clipped surrogate alone, without KL or entropy terms);
        clip_low_count, clip_high_count, dual_clip_count (tokens whose ratio was clipped below
        with A < 0, above with A > 0, or by the dual clip); ratio_sum, ratio_max, ratio_min
        (π/π_old over masked tokens; max/min are ∓float32 max when there are none); kl_sum;
        entropy_sum (only when `entropy` is given); drift_abs_sum and drift_max
        (|logprobs − sampler_logprobs|, only when `sampler_logprobs` is given).
      `finalize_metrics` turns them into the logged means and fractions.
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
    }
    # Reported only when measured: an entropy or drift of 0.0 would read as a real figure.
    if entropy is not None:
        metrics["entropy_sum"] = jnp.sum(jnp.where(on, entropy, 0.0))
    if sampler_logprobs is not None:
        drift = jnp.where(on, jnp.abs(logprobs - sampler_logprobs), 0.0)
        metrics["drift_abs_sum"] = jnp.sum(drift)
        metrics["drift_max"] = jnp.max(drift)
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
    """The logged figures (host floats) from `grpo_loss`'s metrics accumulated over a step.

    `loss/tokens` (the masked tokens), and per masked token: `loss/pg` (the clipped surrogate's
    mean), `clip/low_frac`, `clip/high_frac`, `clip/dual_frac` (fractions clipped),
    `ratio/mean`, `ratio/max`, `ratio/min`, `kl/mean`, `entropy/mean` and
    `drift/logprob_abs_mean`, `drift/logprob_abs_max` (the last three when measured). Without
    tokens there is nothing to average: only `loss/tokens` (0) is returned, no 0.0 stand-ins.
    """
    m = {k: float(v) for k, v in metrics.items()}
    n = m["token_count"]
    out = {"loss/tokens": n}
    if not n:
        return out
    out.update({
        "loss/pg": m["pg_loss_sum"] / n,
        "clip/low_frac": m["clip_low_count"] / n,
        "clip/high_frac": m["clip_high_count"] / n,
        "clip/dual_frac": m["dual_clip_count"] / n,
        "ratio/mean": m["ratio_sum"] / n,
        "ratio/max": m["ratio_max"],
        "ratio/min": m["ratio_min"],
        "kl/mean": m["kl_sum"] / n,
    })
    if "entropy_sum" in m:
        out["entropy/mean"] = m["entropy_sum"] / n
    if "drift_abs_sum" in m:
        out["drift/logprob_abs_mean"] = m["drift_abs_sum"] / n
        out["drift/logprob_abs_max"] = m["drift_max"]
    return out
