"""grpo_loss's objective variants (loss_agg_mode, GSPO, rollout IS / RS, packed sequences) against a
float64 NumPy re-derivation of verl's semantics (core_algos.agg_loss, compute_policy_loss_vanilla /
_gspo, rollout_corr_helper), written one sequence at a time over a plain list of sequences: it knows
nothing of rows, packing or scans, so every layout of the same sequences must give its answer."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl.loss import combine_metrics, finalize_metrics, grpo_loss, grpo_policy_loss
from rstar_jax.rl.registry import get_policy_loss
from rstar_jax.rl.settings import OBJECTIVE_FIELDS, LossConfig

WIDTH = 24  # T: three sequences of up to 8 tokens fit a row
ROWS = 6  # every micro-batch is [ROWS, WIDTH] (empty rows fill it): op-by-op JAX compiles each shape once
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
KINK_MARGIN = 1e-3  # in log-ratio units: float32 and float64 must agree on every branch taken
PAD = dict(lp=-30.0, old=5.0, smp=-2.0, adv=7.0, ref=3.0, ent=9.0)  # garbage in padding: must not count

VARIANTS = {
    "token-mean": dict(),
    "token-mean-dual": dict(dual_clip=3.0),
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", dual_clip=3.0),
    "seq-mean-token-sum-norm-H": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7.5),
    "gspo": dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"),
    "is-token": dict(rollout_is="token", rollout_is_threshold=1.5, dual_clip=3.0),
    "is-sequence": dict(rollout_is="sequence", loss_agg_mode="seq-mean-token-mean"),
    "rs-token": dict(rollout_rs="token", rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.8,
                     loss_agg_mode="seq-mean-token-sum"),
    "rs-sequence": dict(rollout_rs="sequence", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.0,
                        loss_agg_mode="seq-mean-token-mean"),
    "rs-geometric": dict(rollout_rs="geometric", rollout_rs_threshold=1.15),
    "gspo-is-rs": dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", rollout_is="sequence",
                       rollout_is_threshold=1.8, rollout_rs="geometric", rollout_rs_threshold=1.2,
                       rollout_rs_threshold_lower=0.9),
    # token rejection shortens GSPO's sequences: s_i is the mean over the tokens kept
    "gspo-is-rs-token": dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", rollout_is="token",
                             rollout_rs="token", rollout_rs_threshold=1.5),
    "norm-is-rs-kl-entropy": dict(loss_agg_mode="seq-mean-token-sum-norm", rollout_is="token",
                                  rollout_is_threshold=1.3, rollout_rs="token", rollout_rs_threshold=2.0,
                                  dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01),
}
NO_SAMPLER = {"seq-mean-token-sum"}  # one variant without sampler_logprobs: no mismatch metrics then


# ---------------------------------------------------------------- data: a list of sequences, then layouts


def _f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)  # what JAX will see, in float64


def _draw_sequences(rng, n, token_advantages):
    """n sequences of 2-8 tokens; the first has no trained token. Mask holes stand for tool output.
    |logp - old| up to 0.7 (clipping), ~15% at 1.15-1.6 (ratio > 3: dual clip when A < 0); old - sampler
    mostly ~0.05 with ~30% up to 1 (IS truncation, rejection); advantages of both signs."""
    seqs = []
    for i in range(n):
        length = int(rng.integers(2, 9))
        mask = (rng.random(length) < 0.8).astype(np.float64)
        if i == 0:
            mask[:] = 0.0
        elif not mask.any():
            mask[0] = 1.0
        old = rng.uniform(-3.0, -0.05, length)
        delta = rng.uniform(-0.7, 0.7, length)
        far = rng.random(length) < 0.15
        delta[far] = rng.uniform(1.15, 1.6, far.sum())
        drift = np.where(rng.random(length) < 0.3, rng.uniform(-1.0, 1.0, length), rng.normal(0.0, 0.05, length))
        if token_advantages and i % 2:
            adv, scalar = rng.normal(0.0, 1.0, length), False
        else:
            adv, scalar = np.full(length, rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0)), True
        lp = old + delta
        seqs.append(dict(lp=_f32(lp), old=_f32(old), smp=_f32(old - drift), adv=_f32(adv), mask=mask,
                         ref=_f32(lp + rng.normal(0.0, 0.3, length)), ent=_f32(rng.uniform(0.0, 2.0, length)),
                         scalar=scalar))
    return seqs


def _layout(seqs, rows, *, segment_ids=True, row_advantages=False, width=WIDTH, pad=PAD):
    """[B, width] arrays holding `seqs` along `rows` (lists of sequence indices, packed end to end),
    and where each sequence landed: {index: (row, start)}."""
    out = {k: np.full((len(rows), width), v, np.float64) for k, v in pad.items()}
    out["mask"] = np.zeros((len(rows), width))
    seg = np.zeros((len(rows), width), np.int32)
    where = {}
    for r, members in enumerate(rows):
        start = 0
        for k, i in enumerate(members, 1):
            s = seqs[i]
            span = slice(start, start + len(s["lp"]))
            for key in ("lp", "old", "smp", "adv", "ref", "ent", "mask"):
                out[key][r, span] = s[key]
            seg[r, span] = k
            where[i] = (r, start)
            start += len(s["lp"])
        assert start <= width
    if segment_ids:
        out["seg"] = seg
    else:
        assert all(len(members) <= 1 for members in rows)
        out["seg"] = None
    if row_advantages:  # one advantage per row, shape [B]
        assert all(len(m) <= 1 and (not m or seqs[m[0]]["scalar"]) for m in rows)
        out["adv"] = np.array([seqs[m[0]]["adv"][0] if m else PAD["adv"] for m in rows])
    return out, where


def _expected_grad(ref_grads, where, shape):
    full = np.zeros(shape)
    for i, (r, start) in where.items():
        full[r, start:start + len(ref_grads[i])] = ref_grads[i]
    return full


# ---------------------------------------------------------------- the NumPy re-derivation


def _reference(seqs, *, width=WIDTH, sampler=True, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=None,
               log_ratio_clamp=20.0, kl_coef=0.0, entropy_coef=0.0, loss_agg_mode="token-mean",
               loss_scale_factor=None, ratio_level="token", rollout_is=None, rollout_is_threshold=2.0,
               rollout_rs=None, rollout_rs_threshold=None, rollout_rs_threshold_lower=None, lp_override=None):
    """(numerator, denominator, d numerator / d logp per sequence, metrics, margin): verl's objective,
    one sequence at a time. margin is the least distance, in log units, of any branch point (clip
    bounds, dual clip, IS truncation, rejection bounds) from where an input put it."""
    kinks = [math.log(1 - clip_low), math.log(1 + clip_high)] + ([math.log(dual_clip)] if dual_clip else [])
    margin = math.inf
    num = den = 0.0
    grads = []
    m = dict(token_count=0.0, pg_loss_sum=0.0, clip_low_count=0.0, clip_high_count=0.0, dual_clip_count=0.0,
             ratio_sum=0.0, ratio_max=-np.finfo(np.float32).max, ratio_min=np.finfo(np.float32).max, kl_sum=0.0)
    if entropy_coef:
        m["entropy_sum"] = 0.0
    if sampler:
        m.update(drift_abs_sum=0.0, drift_max=0.0, sampled_token_count=0.0, mismatch_k1_sum=0.0,
                 mismatch_k3_sum=0.0)
    if rollout_is:
        m.update(is_weight_sum=0.0, is_weight_raw_max=0.0, is_truncated_count=0.0)
    if rollout_rs:
        m.update(rejected_token_count=0.0, rejected_sequence_count=0.0, sampled_sequence_count=0.0)
    if loss_agg_mode != "token-mean":
        m["sequence_count"] = 0.0
    for i, s in enumerate(seqs):
        lp = s["lp"] if lp_override is None else lp_override[i]
        grad = np.zeros(len(lp))
        grads.append(grad)
        sampled = [t for t in range(len(lp)) if s["mask"][t] > 0]
        weight = {t: 1.0 for t in sampled}
        kept = list(sampled)
        if sampler:
            log_rho = {t: s["old"][t] - s["smp"][t] for t in sampled}  # log(π_old / μ)
            for t in sampled:
                safe = min(max(log_rho[t], -20.0), 20.0)
                m["sampled_token_count"] += 1
                m["mismatch_k1_sum"] += s["smp"][t] - s["old"][t]
                m["mismatch_k3_sum"] += math.exp(safe) - safe - 1.0
            total = sum(log_rho.values())
            if rollout_is:
                for t in sampled:
                    level = log_rho[t] if rollout_is == "token" else total
                    raw = math.exp(min(max(level, -20.0), 20.0))
                    weight[t] = min(raw, rollout_is_threshold)
                    m["is_weight_sum"] += weight[t]
                    m["is_weight_raw_max"] = max(m["is_weight_raw_max"], raw)
                    m["is_truncated_count"] += raw > rollout_is_threshold
                    margin = min(margin, abs(level - math.log(rollout_is_threshold)))
            if rollout_rs:
                upper = rollout_rs_threshold
                lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower

                def inside(level):
                    nonlocal margin
                    margin = min(margin, abs(level - math.log(upper)))
                    if lower > 0:
                        margin = min(margin, abs(level - math.log(lower)))
                    rho = math.exp(min(max(level, -20.0), 20.0))
                    return lower <= rho <= upper

                if rollout_rs == "token":
                    kept = [t for t in sampled if inside(log_rho[t])]
                elif sampled:
                    level = total if rollout_rs == "sequence" else total / len(sampled)
                    kept = sampled if inside(level) else []
                m["rejected_token_count"] += len(sampled) - len(kept)
                m["sampled_sequence_count"] += bool(sampled)
                m["rejected_sequence_count"] += bool(sampled) and len(kept) < len(sampled)  # any rejected
        n = len(kept)
        if not n:
            continue
        if ratio_level == "token":
            log_r, dlog = {}, {}
            for t in kept:
                d = lp[t] - s["old"][t]
                log_r[t], dlog[t] = min(max(d, -log_ratio_clamp), log_ratio_clamp), float(abs(d) < log_ratio_clamp)
        else:  # GSPO: s_i from the kept tokens; d log r_t / d logp_t = 1 (through logp - sg(logp) only)
            mean = sum(lp[t] - s["old"][t] for t in kept) / n
            log_r = {t: min(mean, 10.0) for t in kept}
            dlog = {t: float(mean < 10.0) for t in kept}
        if loss_agg_mode == "token-mean":
            scale = 1.0
        elif loss_agg_mode == "seq-mean-token-mean":
            scale = 1.0 / n
        elif loss_agg_mode == "seq-mean-token-sum":
            scale = 1.0
        else:
            scale = 1.0 / (width if loss_scale_factor is None else loss_scale_factor)
        for t in kept:
            a, r = s["adv"][t], math.exp(log_r[t])
            margin = min([margin] + [abs(log_r[t] - k) for k in kinks])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
            loss, dloss = (unclipped, -a * r * dlog[t]) if unclipped >= clipped else (clipped, 0.0)
            if dual_clip is not None and a < 0 and loss > -a * dual_clip:
                loss, dloss = -a * dual_clip, 0.0
                m["dual_clip_count"] += 1
            m["clip_low_count"] += a < 0 and r < 1 - clip_low
            m["clip_high_count"] += a > 0 and r > 1 + clip_high
            loss, dloss = loss * weight[t], dloss * weight[t]
            m["pg_loss_sum"] += loss
            if kl_coef:  # k3 to the reference, clamped as verl's low_var_kl; not IS-weighted
                delta = s["ref"][t] - lp[t]
                safe = min(max(delta, -20.0), 20.0)
                kl = math.exp(safe) - safe - 1.0
                dkl = (1.0 - math.exp(safe)) if abs(delta) < 20 and abs(kl) < 10 else 0.0
                kl = min(max(kl, -10.0), 10.0)
                m["kl_sum"] += kl
                loss, dloss = loss + kl_coef * kl, dloss + kl_coef * dkl
            if entropy_coef:
                m["entropy_sum"] += s["ent"][t]
                loss -= entropy_coef * s["ent"][t]
            num += scale * loss
            grad[t] = scale * dloss
            m["token_count"] += 1
            m["ratio_sum"] += r
            m["ratio_max"], m["ratio_min"] = max(m["ratio_max"], r), min(m["ratio_min"], r)
            if sampler:
                m["drift_abs_sum"] += abs(lp[t] - s["smp"][t])
                m["drift_max"] = max(m["drift_max"], abs(lp[t] - s["smp"][t]))
        den += n if loss_agg_mode == "token-mean" else 1
        if loss_agg_mode != "token-mean":
            m["sequence_count"] += 1
    return num, den, grads, m, margin


# ---------------------------------------------------------------- running grpo_loss


def _call(arrays, lp, kw, rows=slice(None)):
    """grpo_loss on rows `rows` of the layout, with logprobs `lp` (a traced [B, T] array)."""
    extra = {}
    if kw.get("kl_coef"):
        extra["ref_logprobs"] = jnp.asarray(arrays["ref"][rows], jnp.float32)
    if kw.get("entropy_coef"):
        extra["entropy"] = jnp.asarray(arrays["ent"][rows], jnp.float32)
    if arrays.get("smp") is not None:
        extra["sampler_logprobs"] = jnp.asarray(arrays["smp"][rows], jnp.float32)
    if arrays["seg"] is not None:
        extra["segment_ids"] = jnp.asarray(arrays["seg"][rows])
    return grpo_loss(lp[rows], jnp.asarray(arrays["old"][rows], jnp.float32),
                     jnp.asarray(arrays["adv"][rows], jnp.float32), jnp.asarray(arrays["mask"][rows], jnp.float32),
                     clip_low=CLIP_LOW, clip_high=CLIP_HIGH, **kw, **extra)


def _run(arrays, kw):
    """The objective sum(num) / sum(den) over the layout's micro-batches (blocks of ROWS rows), its
    gradient w.r.t. logprobs (as float64 NumPy), the summed numerator and denominator, and the
    combined metrics."""
    assert arrays["lp"].shape[0] % ROWS == 0

    def objective(lp):
        num = den = 0.0
        metrics = None
        for start in range(0, lp.shape[0], ROWS):
            n, d, mb = _call(arrays, lp, kw, slice(start, start + ROWS))
            num, den = num + n, den + d
            metrics = mb if metrics is None else combine_metrics(metrics, mb)
        return num / den, (num, den, metrics)

    (value, (num, den, metrics)), grad = jax.value_and_grad(objective, has_aux=True)(
        jnp.asarray(arrays["lp"], jnp.float32))
    return (float(value), np.asarray(grad, np.float64), float(num), float(den),
            {k: float(v) for k, v in metrics.items()})


def _case(seed, kw, *, packed, token_advantages):
    """Sequences, a layout of them, and the reference, redrawn until every branch point is clear of the
    inputs (float32 and float64 then take the same branches)."""
    for attempt in range(100):
        rng = np.random.default_rng([seed, attempt])
        if packed:
            seqs = _draw_sequences(rng, 8, token_advantages)
            p = [int(j) for j in rng.permutation(8)]
            rows = [p[0:2], p[2:3], p[3:6], [], p[6:7], p[7:8]]  # an empty row, 1-3 sequences per row
            arrays, where = _layout(seqs, rows)
        else:
            seqs = _draw_sequences(rng, 5, token_advantages)
            rows = [[0], [1], [], [2], [3], [4]]
            arrays, where = _layout(seqs, rows, segment_ids=False,
                                    row_advantages=all(s["scalar"] for s in seqs))
        ref = _reference(seqs, **kw)
        if ref[4] > KINK_MARGIN:
            return seqs, arrays, where, ref
    raise AssertionError("no draw clear of the branch points")


# ---------------------------------------------------------------- 1. each variant against the re-derivation


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_numpy_rederivation(name):
    kw = VARIANTS[name]
    sampler = name not in NO_SAMPLER
    seen = dict.fromkeys(("clip", "dual", "truncated", "rejected", "kept"), 0.0)
    for seed in range(3):
        for packed in (True, False):
            seqs, arrays, where, (num, den, grads, metrics, _) = _case(
                seed, dict(kw, sampler=sampler), packed=packed, token_advantages=seed != 1)
            if not sampler:
                arrays["smp"] = None
            value, grad, got_num, got_den, got = _run(arrays, kw)
            assert den > 0
            np.testing.assert_allclose(got_num, num, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_den, den, rtol=1e-5)
            np.testing.assert_allclose(value, num / den, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(grad, _expected_grad(grads, where, grad.shape) / den, rtol=1e-5, atol=1e-7)
            assert set(got) == set(metrics), f"metric keys: extra {set(got) - set(metrics)}, " \
                                             f"missing {set(metrics) - set(got)}"
            for key, want in metrics.items():
                np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=key)
            seen["clip"] += metrics["clip_low_count"] + metrics["clip_high_count"]
            seen["dual"] += metrics["dual_clip_count"]
            seen["truncated"] += metrics.get("is_truncated_count", 0.0)
            seen["rejected"] += metrics.get("rejected_token_count", 0.0)
            seen["kept"] += metrics["token_count"]
    # The draws exercised what the variant is about (fixed seeds: this only guards the generator).
    assert seen["clip"] > 0 and seen["kept"] > 0
    if kw.get("dual_clip"):
        assert seen["dual"] > 0
    if kw.get("rollout_is"):
        assert seen["truncated"] > 0
    if kw.get("rollout_rs"):
        assert seen["rejected"] > 0


def test_finalized_metrics_are_the_rederived_means():
    kw = dict(loss_agg_mode="seq-mean-token-mean", rollout_is="sequence", rollout_is_threshold=1.5,
              rollout_rs="token", rollout_rs_threshold=1.6, dual_clip=3.0)
    _, arrays, _, (_, den, _, m, _) = _case(11, kw, packed=True, token_advantages=True)
    out = finalize_metrics(_run(arrays, kw)[4])
    sampled = m["sampled_token_count"]
    want = {
        "loss/tokens": m["token_count"], "loss/sequences": den,
        "mismatch/kl_k1": m["mismatch_k1_sum"] / sampled, "mismatch/kl_k3": m["mismatch_k3_sum"] / sampled,
        "rollout_is/weight_mean": m["is_weight_sum"] / sampled, "rollout_is/raw_max": m["is_weight_raw_max"],
        "rollout_is/truncated_frac": m["is_truncated_count"] / sampled,
        "rollout_rs/token_frac": m["rejected_token_count"] / sampled,
        "rollout_rs/sequence_frac": m["rejected_sequence_count"] / m["sampled_sequence_count"],
        "clip/dual_frac": m["dual_clip_count"] / m["token_count"],
    }
    for key, value in want.items():
        np.testing.assert_allclose(out[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert 0 < out["rollout_rs/token_frac"] < 1 and 0 < out["rollout_is/truncated_frac"] < 1


def test_sequence_counts_are_whole_numbers():
    """Counts, not float sums of 1/|i| (a 10- and an 8-token sequence once summed to 2.0000005)."""
    z = jnp.zeros((ROWS, WIDTH), jnp.float32)
    mask = z.at[0, :10].set(1.0).at[1, :8].set(1.0)
    sampler = z.at[1, 0].set(-2.0)  # ρ = e^2 at one token of the second sequence: that token is rejected
    _, den, m = grpo_loss(z, z, jnp.ones((ROWS,), jnp.float32), mask, loss_agg_mode="seq-mean-token-mean",
                          sampler_logprobs=sampler, rollout_rs="token", rollout_rs_threshold=1.5)
    assert float(m["rejected_token_count"]) == 1.0
    got = dict(denominator=float(den), sequence_count=float(m["sequence_count"]),
               sampled_sequence_count=float(m["sampled_sequence_count"]),
               rejected_sequence_count=float(m["rejected_sequence_count"]))
    # One token of the second sequence rejected: it still trains (2 sequences), and counts as a
    # sequence with a rejection (verl's rollout_rs_seq_masked_fraction).
    assert got == dict(denominator=2.0, sequence_count=2.0, sampled_sequence_count=2.0, rejected_sequence_count=1.0)


# ---------------------------------------------------------------- 2. gradients against finite differences


def _finite_difference(seqs, kw, eps=1e-6):
    _, den, _, _, _ = _reference(seqs, **kw)
    grads = []
    for i, s in enumerate(seqs):
        g = np.zeros(len(s["lp"]))
        for t in range(len(g)):
            values = []
            for step in (eps, -eps):
                lp = [x["lp"].copy() for x in seqs]
                lp[i][t] += step
                values.append(_reference(seqs, lp_override=lp, **kw)[0])
            g[t] = (values[0] - values[1]) / (2 * eps) / den
        grads.append(g)
    return grads


@pytest.mark.parametrize("kw, token_advantages", [
    (dict(rollout_is="token", rollout_is_threshold=1.5, dual_clip=3.0), True),
    (dict(rollout_is="token", rollout_is_threshold=1.5, loss_agg_mode="seq-mean-token-mean"), True),
    (dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0, rollout_rs="token", rollout_rs_threshold=1.5), True),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.1), True),
    # GSPO's stop-gradient surrogate has the true gradient of its sequence objective when the
    # advantage and the IS weight are one per sequence: finite differences apply then.
    (dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"), False),
    (dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", rollout_is="sequence",
          rollout_rs="geometric", rollout_rs_threshold=1.2), False),
], ids=["is-token", "is-token-seq-mean", "seq-mean-token-mean-rs", "token-sum-norm-kl", "gspo", "gspo-is-rs"])
def test_gradient_matches_finite_differences(kw, token_advantages):
    seqs, arrays, where, _ = _case(5, kw, packed=True, token_advantages=token_advantages)
    fd = _finite_difference(seqs, kw)
    _, grad, _, _, _ = _run(arrays, kw)
    np.testing.assert_allclose(grad, _expected_grad(fd, where, grad.shape), rtol=1e-4, atol=1e-6)
    assert np.abs(grad).max() > 0


def test_gspo_gradient_flows_per_token_not_through_the_sequence_ratio():
    """With per-token advantages, d ℓ_t / d logp_t = -A_t·s_i·w (unclipped tokens), 0 for the others:
    the gradient of exp(sg(log s_i) + logp_t - sg(logp_t)), not of s_i's mean over the sequence."""
    kw = dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", rollout_is="token",
              rollout_is_threshold=1.5)
    seqs, arrays, where, (_, den, _, _, _) = _case(3, kw, packed=True, token_advantages=True)
    _, grad, _, _, _ = _run(arrays, kw)
    expected = []
    for s in seqs:
        g = np.zeros(len(s["lp"]))
        on = s["mask"] > 0
        if on.any():
            si = math.exp(np.mean((s["lp"] - s["old"])[on]))
            for t in np.flatnonzero(on):
                a = s["adv"][t]
                w = min(math.exp(s["old"][t] - s["smp"][t]), 1.5)
                unclipped_wins = -a * si >= -a * min(max(si, 1 - CLIP_LOW), 1 + CLIP_HIGH)
                g[t] = -a * si * w / on.sum() if unclipped_wins else 0.0
        expected.append(g)
    np.testing.assert_allclose(grad, _expected_grad(expected, where, grad.shape) / den, rtol=1e-5, atol=1e-7)
    fd = _finite_difference(seqs, dict(kw))  # the gradient of the sequence objective itself differs
    assert not np.allclose(grad, _expected_grad(fd, where, grad.shape), rtol=1e-3, atol=1e-5)


def test_log_ratio_clamps():
    """Token level: log(π/π_old) clamped to ±log_ratio_clamp (no gradient beyond). GSPO: log s_i
    clamped at 10 above (no gradient there), not below."""
    old = jnp.zeros((ROWS, WIDTH), jnp.float32)
    mask = jnp.zeros((ROWS, WIDTH), jnp.float32).at[0, :2].set(1.0).at[1, :2].set(1.0)
    adv = jnp.zeros((ROWS,), jnp.float32).at[0].set(-1.0).at[1].set(1.0)
    lp = old.at[0, :2].set(jnp.array([0.7, 13.0])).at[1, :2].set(jnp.array([-0.7, -0.1]))
    loss = lambda x: grpo_loss(x, old, adv, mask, log_ratio_clamp=0.5)[0]  # noqa: E731
    # row 0, A < 0: r = e^0.5 both (the unclipped branch); row 1, A > 0: r = e^-0.5 (clamped), e^-0.1
    np.testing.assert_allclose(float(loss(lp)), 2 * math.exp(0.5) - math.exp(-0.5) - math.exp(-0.1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(lp))[:2, :2], [[0, 0], [0, -math.exp(-0.1)]], atol=1e-7)

    lp = old.at[0, :2].set(jnp.array([12.0, 13.0])).at[1, :2].set(jnp.array([-14.0, -16.0]))
    gspo = lambda x: grpo_loss(x, old, adv, mask, ratio_level="sequence",  # noqa: E731
                               loss_agg_mode="seq-mean-token-mean")[:2]
    num, den = gspo(lp)
    assert float(den) == 2.0
    # row 0: s = e^12.5 clamped to e^10 (A < 0: unclipped); row 1: s = e^-15, kept (A > 0: -s beats -0.8)
    np.testing.assert_allclose(float(num), math.exp(10.0) - math.exp(-15.0), rtol=1e-6)
    grad = np.asarray(jax.grad(lambda x: gspo(x)[0])(lp))
    np.testing.assert_allclose(grad[:2, :2], [[0, 0], [-math.exp(-15.0) / 2] * 2], rtol=1e-5, atol=0)


# ---------------------------------------------------------------- 3. micro-batching and packing


def _exactness_sequences():
    for attempt in range(100):
        rng = np.random.default_rng([7, attempt])
        seqs = _draw_sequences(rng, 6, token_advantages=True)
        if min(_reference(seqs, **dict(kw, sampler=True))[4] for kw in EXACTNESS) > KINK_MARGIN:
            return seqs
    raise AssertionError("no draw clear of the branch points")


EXACTNESS = [
    dict(loss_agg_mode="token-mean", dual_clip=3.0, rollout_is="token", rollout_rs="sequence", rollout_rs_threshold=3.0),
    dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0, rollout_is="sequence", rollout_rs="token",
         rollout_rs_threshold=1.5),
    dict(loss_agg_mode="seq-mean-token-sum", rollout_is="token", rollout_rs="geometric", rollout_rs_threshold=1.15),
    dict(loss_agg_mode="seq-mean-token-sum-norm", dual_clip=3.0),
    dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=5.0, rollout_is="sequence", rollout_rs="token",
         rollout_rs_threshold=1.5),
    dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"),
    dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", rollout_is="sequence",
         rollout_rs="geometric", rollout_rs_threshold=1.15),
]
# (rows, segment_ids, micro-batch counts): one sequence per row, then packed two ways; sequence 0 has
# no trained token and ends up alone in a micro-batch in the first layout.
LAYOUTS = [
    ([[0], [1], [2], [3], [4], [5]], False, (1, 2, 4)),
    ([[0], [1], [2], [3], [4], [5]], True, (1,)),
    ([[0, 1], [2, 3, 4], [5]], True, (1, 2)),
    ([[4, 5, 0], [], [3], [1, 2]], True, (1, 4)),
]


def _micro_batched(rows, micro_batches):
    """`rows` split into `micro_batches` consecutive parts, each filled up to ROWS with empty rows."""
    out = []
    for part in np.array_split(np.arange(len(rows)), micro_batches):
        out += [rows[j] for j in part] + [[] for _ in range(ROWS - len(part))]
    return out


@pytest.mark.parametrize("kw", EXACTNESS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_micro_batching_and_packing_are_exact(kw):
    seqs = _exactness_sequences()
    base_arrays, base_where = _layout(seqs, LAYOUTS[0][0], segment_ids=False)
    base_value, base_grad, _, base_den, base_metrics = _run(base_arrays, kw)
    per_sequence = {i: base_grad[r, s:s + len(seqs[i]["lp"])] for i, (r, s) in base_where.items()}
    base_final = finalize_metrics(base_metrics)
    num, den, _, _, _ = _reference(seqs, **dict(kw, sampler=True))
    np.testing.assert_allclose(base_value, num / den, rtol=1e-5)
    for rows, segment_ids, splits in LAYOUTS:
        for micro_batches in splits:
            arrays, where = _layout(seqs, _micro_batched(rows, micro_batches), segment_ids=segment_ids)
            value, grad, _, got_den, metrics = _run(arrays, kw)
            np.testing.assert_allclose(value, base_value, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got_den, base_den, rtol=1e-6)
            np.testing.assert_allclose(grad, _expected_grad(per_sequence, where, grad.shape), rtol=1e-6, atol=1e-6)
            final = finalize_metrics(metrics)
            assert set(final) == set(base_final)
            for key in final:
                np.testing.assert_allclose(final[key], base_final[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", ["gspo-is-rs", "norm-is-rs-kl-entropy", "seq-mean-token-mean", "rs-sequence"])
def test_garbage_in_masked_positions_changes_nothing(name):
    """Masked log-probs (and entropies, references) may hold anything, -inf and nan included: the same
    loss and a finite gradient (advantages there stay finite: nan · 0 would be nan in any backward)."""
    kw = VARIANTS[name]
    seqs, _, _, _ = _case(2, kw, packed=True, token_advantages=True)
    clean, _ = _layout(seqs, [[0, 1], [2], [3, 4, 5], [], [6], [7]])
    dirty = dict(clean)
    off = clean["mask"] == 0  # padding and the holes inside sequences
    for key, junk in dict(lp=-np.inf, old=np.nan, smp=np.inf, adv=-1e30, ref=np.nan, ent=np.nan).items():
        dirty[key] = np.where(off, junk, clean[key])
    v_clean, g_clean, _, _, _ = _run(clean, kw)
    v_dirty, g_dirty, _, _, m_dirty = _run(dirty, kw)
    assert v_clean == v_dirty and np.isfinite(v_dirty)
    assert np.all(np.isfinite(g_dirty)) and np.array_equal(g_clean, g_dirty)
    assert all(np.isfinite(v) for v in m_dirty.values())


# ---------------------------------------------------------------- 4. the default is the previous objective


def _previous(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=None, log_ratio_clamp=20.0):
    """The token-mean loss as it was before the variants, formula for formula."""
    mask = mask.astype(jnp.float32)
    on = mask > 0
    adv = jnp.asarray(adv)
    if adv.ndim == lp.ndim - 1:
        adv = adv[..., None]
    adv = jnp.broadcast_to(adv, lp.shape).astype(jnp.float32)
    log_ratio = jnp.where(on, lp - old, 0.0)
    log_ratio = jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * dual_clip), per_token)
    return jnp.sum(jnp.where(on, per_token, 0.0)), jnp.sum(mask)


@pytest.mark.parametrize("extra", [{}, {"dual_clip": 3.0}, {"sampler": True}, {"dual_clip": 3.0, "sampler": True},
                                   {"dual_clip": 3.0, "sampler": True, "segment_ids": True}],
                         ids=["plain", "dual", "sampler", "dual-sampler", "dual-sampler-segments"])
@pytest.mark.parametrize("row_advantages", [False, True])
def test_default_is_the_previous_implementation_bit_for_bit(extra, row_advantages):
    rng = np.random.default_rng(0)
    seqs = _draw_sequences(rng, 5, token_advantages=not row_advantages)
    arrays, _ = _layout(seqs, [[0], [1], [], [2], [3], [4]], segment_ids=True, row_advantages=row_advantages)
    lp, old, adv, mask = (jnp.asarray(arrays[k], jnp.float32) for k in ("lp", "old", "adv", "mask"))
    kw = {"dual_clip": extra["dual_clip"]} if "dual_clip" in extra else {}
    new_kw = dict(kw)
    if extra.get("sampler"):
        new_kw["sampler_logprobs"] = jnp.asarray(arrays["smp"], jnp.float32)
    if extra.get("segment_ids"):
        new_kw["segment_ids"] = jnp.asarray(arrays["seg"])
    old_sum, old_count = _previous(lp, old, adv, mask, **kw)
    old_grad = jax.grad(lambda x: _previous(x, old, adv, mask, **kw)[0])(lp)
    new_sum, new_count, _ = grpo_loss(lp, old, adv, mask, **new_kw)
    new_grad = jax.grad(lambda x: grpo_loss(x, old, adv, mask, **new_kw)[0])(lp)
    assert np.array_equal(np.asarray(new_sum), np.asarray(old_sum))
    assert np.array_equal(np.asarray(new_count), np.asarray(old_count))
    assert np.array_equal(np.asarray(new_grad), np.asarray(old_grad))
    jitted = jax.jit(lambda x: grpo_loss(x, old, adv, mask, **new_kw)[:2])(lp)
    previous = jax.jit(lambda x: _previous(x, old, adv, mask, **kw))(lp)
    assert np.array_equal(np.asarray(jitted[0]), np.asarray(previous[0]))


# ---------------------------------------------------------------- 5. refusals


def _tiny():
    x = jnp.zeros((ROWS, WIDTH), jnp.float32)
    return x, x, jnp.ones((ROWS,), jnp.float32), jnp.ones((ROWS, WIDTH), jnp.float32)


@pytest.mark.parametrize("kw, names", [
    (dict(ratio_level="sequence"), ("ratio_level", "loss_agg_mode")),
    (dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-sum"), ("ratio_level", "loss_agg_mode")),
    (dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-sum-norm"), ("ratio_level", "loss_agg_mode")),
    (dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", dual_clip=3.0), ("ratio_level", "dual_clip")),
    (dict(loss_agg_mode="token-sum"), ("loss_agg_mode",)),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0.0), ("loss_scale_factor",)),
    (dict(ratio_level="geometric"), ("ratio_level",)),
    (dict(rollout_is="geometric", sampler=True), ("rollout_is",)),
    (dict(rollout_is="token", rollout_is_threshold=0.0, sampler=True), ("rollout_is_threshold",)),
    (dict(rollout_rs="tokens", rollout_rs_threshold=2.0, sampler=True), ("rollout_rs",)),
    (dict(rollout_rs="token", sampler=True), ("rollout_rs_threshold",)),
    (dict(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0, sampler=True),
     ("rollout_rs_threshold_lower",)),
    (dict(rollout_is="token"), ("sampler_logprobs", "rollout_is")),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0), ("sampler_logprobs", "rollout_rs")),
])
def test_refusals_name_the_argument(kw, names):
    kw = dict(kw)
    lp, old, adv, mask = _tiny()
    if kw.pop("sampler", False):
        kw["sampler_logprobs"] = lp
    with pytest.raises(ValueError) as raised:
        grpo_loss(lp, old, adv, mask, **kw)
    for name in names:
        assert name in str(raised.value)


def test_loss_config_refuses_the_same_with_its_field_name():
    with pytest.raises(ValueError, match=r"LossConfig\.ratio_level"):
        LossConfig(ratio_level="sequence")
    with pytest.raises(ValueError, match=r"LossConfig\.ratio_level.*dual_clip"):
        LossConfig(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", dual_clip=3.0)
    with pytest.raises(ValueError, match=r"LossConfig\.rollout_rs_threshold"):
        LossConfig(rollout_rs="token")
    with pytest.raises(ValueError, match=r"LossConfig\.loss_agg_mode"):
        LossConfig(loss_agg_mode="sum")


def test_segment_ids_of_another_shape_are_refused():
    lp, old, adv, mask = _tiny()
    with pytest.raises(ValueError, match="segment_ids"):
        grpo_loss(lp, old, adv, mask, segment_ids=jnp.ones((ROWS, 3), jnp.int32), loss_agg_mode="seq-mean-token-mean")


# ---------------------------------------------------------------- 6. the registered loss passes every field


def test_every_grpo_loss_objective_keyword_is_a_loss_config_field():
    keywords = {name for name, p in inspect.signature(grpo_loss).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    passed_apart = {"clip_low", "clip_high", "dual_clip", "log_ratio_clamp", "ref_logprobs", "kl_coef", "entropy",
                    "entropy_coef", "sampler_logprobs", "segment_ids"}
    assert keywords - passed_apart == set(OBJECTIVE_FIELDS)
    assert set(OBJECTIVE_FIELDS) <= set(LossConfig.__dataclass_fields__)
    defaults = {name: inspect.signature(grpo_loss).parameters[name].default for name in OBJECTIVE_FIELDS}
    assert LossConfig().objective() == defaults


@pytest.mark.parametrize("fields", [
    dict(loss_agg_mode="seq-mean-token-sum"),
    dict(loss_agg_mode="seq-mean-token-mean"),
    dict(loss_agg_mode="seq-mean-token-sum-norm"),
    dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=5.0),
    dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"),
    dict(rollout_is="token"),
    dict(rollout_is="sequence", rollout_is_threshold=1.3),
    dict(rollout_rs="token", rollout_rs_threshold=1.5),
    dict(rollout_rs="geometric", rollout_rs_threshold=1.15, rollout_rs_threshold_lower=0.95),
    dict(rollout_rs="sequence", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.0, dual_clip=3.0,
         clip_low=0.1, clip_high=0.4),
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_registered_loss_passes_every_objective_field(fields):
    seqs, arrays, _, _ = _case(4, {}, packed=True, token_advantages=True)
    args = [jnp.asarray(arrays[k], jnp.float32) for k in ("lp", "old", "adv", "mask")]
    extras = dict(sampler_logprobs=jnp.asarray(arrays["smp"], jnp.float32), segment_ids=jnp.asarray(arrays["seg"]))
    settings = LossConfig(**fields)
    registered = get_policy_loss("grpo")
    assert registered is grpo_policy_loss
    got = registered(settings, *args, **extras, entropy=None, some_future_extra=jnp.zeros(3))
    direct_kw = {k: fields[k] for k in fields if k in OBJECTIVE_FIELDS}
    direct = grpo_loss(*args, clip_low=settings.clip_low, clip_high=settings.clip_high,
                       dual_clip=settings.dual_clip, **extras, **direct_kw)
    default = grpo_loss(*args, clip_low=settings.clip_low, clip_high=settings.clip_high,
                        dual_clip=settings.dual_clip, **extras)
    for a, b in zip(got[:2], direct[:2]):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert set(got[2]) == set(direct[2])
    for key in got[2]:
        assert np.array_equal(np.asarray(got[2][key]), np.asarray(direct[2][key])), key
    # Each field changes the result here, so one dropped on the way would show.
    assert (float(got[0]) / float(got[1]) != float(default[0]) / float(default[1])) or set(got[2]) != set(default[2])
