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

from rstar_jax.rl import correction
from rstar_jax.rl.registry import register_policy_loss
from rstar_jax.rl.sequences import count_sequences, segment_totals, segments_of, sequence_weights
from rstar_jax.rl.settings import LossConfig, check_objective  # LossConfig lives apart: configs checked without jax


MAX_METRICS = ("ratio_max", "drift_max", "is_weight_raw_max")
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's log-ratio at 10 above (none below)
MIN_METRICS = ("ratio_min",)


@jax.named_scope("grpo_loss")
def grpo_loss(logprobs, old_logprobs, advantages, loss_mask, *, clip_low=0.2, clip_high=0.28, dual_clip=None,
              log_ratio_clamp=20.0, ref_logprobs=None, kl_coef=0.0, entropy=None, entropy_coef=0.0,
              sampler_logprobs=None, segment_ids=None, loss_agg_mode="token-mean", loss_scale_factor=None,
              ratio_level="token", rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None,
              rollout_rs_threshold=None, rollout_rs_threshold_lower=None):
    """PPO-clip policy loss as a (numerator, denominator) pair; by default rStar2-Agent's Eq. 6
    (verl's "vanilla" policy loss, token-mean, clip-higher, no KL).

    Per token t of sequence i, with r = π_θ / π_old (log-ratio clamped to ±log_ratio_clamp):
      ℓ_t = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)), and with dual_clip c, for A < 0,
      ℓ_t = min(ℓ_t, −A·c); times the rollout-correction weight w_t when `rollout_is` is set;
      plus kl_coef·k3(π_θ, π_ref) − entropy_coef·H_t when given.
    Aggregation (`loss_agg_mode`, verl's names; M the trained tokens, S the sequences with one):
      "token-mean"              Σ_t ℓ_t / |M|                      (the paper's; the default)
      "seq-mean-token-mean"     Σ_i (Σ_{t∈i} ℓ_t / |i|) / |S|
      "seq-mean-token-sum"      Σ_i Σ_{t∈i} ℓ_t / |S|
      "seq-mean-token-sum-norm" Σ_i Σ_{t∈i} ℓ_t / (|S|·H)           (Dr.GRPO; H = loss_scale_factor,
                                                                   default loss_mask.shape[-1])
    The first value returned is the numerator, the second the denominator: summed over micro-batches
    and divided once, each mode is exact over the global batch whatever the micro-batching or packing.
    `ratio_level="sequence"` is GSPO: s_i = exp(Σ_{t∈i} log r_t / |i|), used per token as
    exp(sg(log s_i) + log π_θ − sg(log π_θ)), that log clamped at 10 above; it aggregates
    "seq-mean-token-mean" and has no dual-clip (other combinations are refused).
    Rollout correction (verl's decoupled reading; `rstar_jax.rl.correction`), ρ = π_old / μ with μ
    the sampler (`sampler_logprobs`): `rollout_is` ("token" | "sequence") multiplies ℓ_t by
    sg(min(ρ, rollout_is_threshold)), ρ per token or the sequence's product; `rollout_rs` ("token" |
    "sequence" | "geometric") removes tokens or whole sequences whose ρ (per token, product, geometric
    mean) leaves [rollout_rs_threshold_lower (None: 1/upper; 0: none), rollout_rs_threshold] from
    numerator and denominator alike. Both use the original mask. `sampler_logprobs` alone corrects
    nothing; it adds the mismatch metrics.

    Args:
      logprobs: [..., T] log-probs of the taken tokens under the policy being trained.
      old_logprobs: [..., T] the same under the policy that produced the batch (π_old: the trainer's
        recomputation, the proximal policy of decoupled PPO).
      advantages: per token ([..., T], or broadcastable to it) or per sequence ([...], one value
        per row, as `group_advantages` returns them); any other shape is refused.
      loss_mask: [..., T], nonzero on the tokens that count (the model's own tokens; not the
        prompt, tool output or padding). Masked positions may hold anything, even -inf.
      clip_low, clip_high: the ratio's clip range (clip-higher: DAPO's 0.2 / 0.28, the paper's).
      dual_clip: None, or c > 1 (verl's `clip_ratio_c`, 3.0 there and in the rStar2 release).
      log_ratio_clamp: log(π/π_old) is clamped to ±this before exp, for stability (token level).
      ref_logprobs, kl_coef: an optional k3 KL penalty to a reference policy (off in the recipe).
      entropy, entropy_coef: optional per-token entropies and a bonus coefficient (off in the
        recipe); given entropies are also reported.
      sampler_logprobs: optional [..., T] log-probs the generator reported (μ): the drift and
        mismatch metrics, and what rollout correction compares π_old with.
      segment_ids: [..., T] which packed sequence each token belongs to (1..k along a row, 0 for
        padding, each sequence contiguous); None: each row is one sequence. Only sequence-level
        options read it.
      loss_agg_mode, loss_scale_factor, ratio_level, rollout_is, rollout_is_threshold, rollout_rs,
        rollout_rs_threshold, rollout_rs_threshold_lower: the variants above.

    Returns:
      (loss_sum, denominator, metrics): the gradient of sum(loss_sum) / sum(denominator) over all
      micro-batches is the exact objective. The denominator is the trained-token count for
      "token-mean", the count of sequences with a trained token otherwise. Dividing by a total of 0
      is the caller's to avoid (`jnp.maximum(total, 1)`: a batch without tokens then contributes a
      zero gradient). metrics, all fp32 scalars with the gradient stopped, additive across
      micro-batches (`combine_metrics`):
        token_count (trained tokens); pg_loss_sum (Σ ℓ_t over them, without KL or entropy terms);
        clip_low_count, clip_high_count, dual_clip_count (tokens clipped below with A < 0, above
        with A > 0, or by the dual clip); ratio_sum, ratio_max, ratio_min (the clipped ratio's
        r; max/min are ∓float32 max when there are none); kl_sum;
        sequence_count (sequences with a trained token; sequence aggregation only);
        entropy_sum (only when `entropy` is given);
        with `sampler_logprobs`: drift_abs_sum, drift_max (|log π_θ − log μ|), sampled_token_count
        (tokens before rejection), mismatch_k1_sum, mismatch_k3_sum (KL(μ ‖ π_old) estimates, k1
        = −log ρ, k3 = ρ − log ρ − 1, over those tokens);
        with `rollout_is`: is_weight_sum (the applied weights), is_weight_raw_max (ρ before
        truncation), is_truncated_count; with `rollout_rs`: rejected_token_count,
        rejected_sequence_count (sequences with a rejected token, as verl counts them),
        sampled_sequence_count.
      `finalize_metrics` turns them into the logged means and fractions.
    """
    check_objective(loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, ratio_level=ratio_level,
                    dual_clip=dual_clip, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                    rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold,
                    rollout_rs_threshold_lower=rollout_rs_threshold_lower)
    if (rollout_is or rollout_rs) and sampler_logprobs is None:
        raise ValueError("grpo_loss: rollout_is and rollout_rs compare old_logprobs with sampler_logprobs; "
                         "pass sampler_logprobs")
    mask = loss_mask.astype(jnp.float32)
    advantages = jnp.asarray(advantages)
    if advantages.ndim == logprobs.ndim - 1:  # one per sequence: the same for each of its tokens
        advantages = advantages[..., None]
    try:
        advantages = jnp.broadcast_to(advantages, logprobs.shape).astype(jnp.float32)
    except ValueError:
        raise ValueError(f"grpo_loss: advantages of shape {advantages.shape} fit neither logprobs' "
                         f"{logprobs.shape} (per token) nor {logprobs.shape[:-1]} (per sequence)") from None
    needs_segments = (loss_agg_mode != "token-mean" or ratio_level == "sequence" or rollout_is == "sequence"
                      or rollout_rs in ("sequence", "geometric"))
    segments = segments_of(loss_mask, segment_ids) if needs_segments else None
    extra = {}
    is_weights = None
    if sampler_logprobs is not None:
        # The behaviour ratio ρ = π_old / μ on the original mask: mismatch, IS weights, rejection.
        sampled = mask
        behaviour = correction.behaviour_log_ratio(old_logprobs, sampler_logprobs, sampled)
        extra["sampled_token_count"] = jnp.sum(sampled)
        extra["mismatch_k1_sum"], extra["mismatch_k3_sum"] = correction.mismatch_sums(behaviour, sampled)
        if rollout_is is not None:
            is_weights, raw = correction.importance_weights(behaviour, sampled, segments, rollout_is,
                                                            rollout_is_threshold)
            extra["is_weight_sum"] = jnp.sum(is_weights)
            extra["is_weight_raw_max"] = jnp.max(raw)
            extra["is_truncated_count"] = jnp.sum(jnp.where(sampled > 0, raw > rollout_is_threshold, False)
                                                  .astype(jnp.float32))
        if rollout_rs is not None:
            keep = correction.rejection_mask(behaviour, sampled, segments, rollout_rs, rollout_rs_threshold,
                                             rollout_rs_threshold_lower)
            mask = sampled * keep
            all_segments = segments_of(loss_mask, segment_ids)
            rejected = sampled - mask
            extra["rejected_token_count"] = jnp.sum(rejected)
            # As verl's rollout_rs_seq_masked_fraction: a sequence counts once any of its tokens is rejected.
            extra["rejected_sequence_count"] = count_sequences(sampled, all_segments,
                                                               where=segment_totals(rejected, all_segments) > 0)
            extra["sampled_sequence_count"] = count_sequences(sampled, all_segments)
    on = mask > 0
    if ratio_level == "token":
        # Masked positions may hold anything (padding, -inf): zero them before exp.
        log_ratio = jnp.where(on, logprobs - old_logprobs, 0.0)
        log_ratio = jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    else:
        token_log_ratio = jnp.where(on, logprobs - old_logprobs, 0.0)
        sequence_log_ratio = segment_totals(token_log_ratio, segments) / jnp.maximum(segment_totals(mask, segments),
                                                                                     1.0)
        log_ratio = jax.lax.stop_gradient(sequence_log_ratio) + logprobs - jax.lax.stop_gradient(logprobs)
        log_ratio = jnp.where(on, jnp.minimum(log_ratio, GSPO_LOG_RATIO_MAX), 0.0)
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
    if is_weights is not None:
        per_token = per_token * is_weights
    pg_loss = per_token
    kl = jnp.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef:
        # k3 estimator of KL(pi || ref), as verl's "low_var_kl", clamped for stability.
        delta = jnp.clip(jnp.where(on, ref_logprobs - logprobs, 0.0), -20.0, 20.0)
        kl = jnp.clip(jnp.exp(delta) - delta - 1.0, -10.0, 10.0)
        per_token = per_token + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    token_count = jnp.sum(mask)
    if loss_agg_mode == "token-mean":
        loss_sum = jnp.sum(jnp.where(on, per_token, 0.0))
        denominator = token_count
    else:
        inverse_length, sequence_count = sequence_weights(mask, segments)
        if loss_agg_mode == "seq-mean-token-mean":
            token_weight = inverse_length
        elif loss_agg_mode == "seq-mean-token-sum":
            token_weight = mask
        else:  # seq-mean-token-sum-norm
            scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
            token_weight = mask / scale
        loss_sum = jnp.sum(jnp.where(on, per_token * token_weight, 0.0))
        denominator = sequence_count
        extra["sequence_count"] = sequence_count
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
    metrics.update(extra)
    return loss_sum, denominator, jax.lax.stop_gradient(metrics)


@register_policy_loss("grpo")
def grpo_policy_loss(settings: LossConfig, logprobs, old_logprobs, advantages, loss_mask, *, entropy=None,
                     sampler_logprobs=None, segment_ids=None, **unused_extras):
    """`grpo_loss` with its coefficients and variant from `settings`: the registered default,
    "grpo" as the objective is named in rStar2-Agent (GRPO-RoC) and in tunix's registry."""
    return grpo_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low=settings.clip_low,
                     clip_high=settings.clip_high, dual_clip=settings.dual_clip,
                     log_ratio_clamp=settings.log_ratio_clamp, entropy=entropy,
                     entropy_coef=settings.entropy_coef, sampler_logprobs=sampler_logprobs,
                     segment_ids=segment_ids, **settings.objective())


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

    `loss/tokens` (the trained tokens), and per trained token: `loss/pg` (the surrogate's mean),
    `clip/low_frac`, `clip/high_frac`, `clip/dual_frac` (fractions clipped), `ratio/mean`,
    `ratio/max`, `ratio/min`, `kl/mean`, `entropy/mean` and `drift/logprob_abs_mean`,
    `drift/logprob_abs_max` (the last three when measured); `loss/sequences` under a sequence
    aggregation. Per sampled token (before rejection), when sampler log-probs were given:
    `mismatch/kl_k1`, `mismatch/kl_k3`; with rollout IS `rollout_is/weight_mean`,
    `rollout_is/raw_max`, `rollout_is/truncated_frac`; with rejection `rollout_rs/token_frac`,
    `rollout_rs/sequence_frac` (the fractions rejected). A figure without a denominator is absent,
    never a 0.0 stand-in: without trained tokens only `loss/tokens` (0) and what the sampled
    tokens give are returned.
    """
    m = {k: float(v) for k, v in metrics.items()}
    n = m["token_count"]
    out = {"loss/tokens": n}
    if "sequence_count" in m:
        out["loss/sequences"] = m["sequence_count"]
    sampled = m.get("sampled_token_count", 0.0)
    if sampled:
        out["mismatch/kl_k1"] = m["mismatch_k1_sum"] / sampled
        out["mismatch/kl_k3"] = m["mismatch_k3_sum"] / sampled
        if "is_weight_sum" in m:
            out["rollout_is/weight_mean"] = m["is_weight_sum"] / sampled
            out["rollout_is/raw_max"] = m["is_weight_raw_max"]
            out["rollout_is/truncated_frac"] = m["is_truncated_count"] / sampled
        if "rejected_token_count" in m:
            out["rollout_rs/token_frac"] = m["rejected_token_count"] / sampled
            if m["sampled_sequence_count"]:
                out["rollout_rs/sequence_frac"] = m["rejected_sequence_count"] / m["sampled_sequence_count"]
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
