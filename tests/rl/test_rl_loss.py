"""grpo_loss: hand-computed branches and an independent NumPy re-derivation of loss and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl.loss import combine_metrics, finalize_metrics, grpo_loss


def _loss(lp, old, adv, mask, **kw):
    return grpo_loss(jnp.asarray(lp, jnp.float32), jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                     jnp.asarray(mask, jnp.float32), **kw)


def test_every_branch_by_hand():
    ln = np.log
    # token: inside clip (A>0) | clipped high (A>0, r=1.5) | clipped low (A<0, r=0.5) |
    #        dual clip (A<0, r=4, c=3) | A<0 unclipped (r=1.1) | masked (garbage values)
    ratio = np.array([1.1, 1.5, 0.5, 4.0, 1.1, 123.0])
    adv = np.array([2.0, 1.0, -1.0, -0.5, -2.0, 5.0])
    mask = np.array([1, 1, 1, 1, 1, 0])
    old = np.zeros(6)
    lp = ln(ratio)
    loss_sum, count, m = _loss(lp, old, adv, mask, dual_clip=3.0)
    expected = [
        -2.0 * 1.1,  # max(-2*1.1, -2*1.1)
        -1.0 * 1.28,  # max(-1.5, -1.28): clipped at 1 + 0.28
        1.0 * 0.8,  # A=-1: max(0.5, 0.8): clipped at 1 - 0.2
        0.5 * 3.0,  # A=-0.5: max(2.0, 0.5*1.28=0.64) = 2.0, dual: min(2.0, 1.5) = 1.5
        2.0 * 1.1,  # A=-2, r=1.1 is inside the clip range: both branches give 2.2
    ]
    assert float(count) == 5
    np.testing.assert_allclose(float(loss_sum), sum(expected), rtol=1e-6)
    assert float(m["clip_high_count"]) == 1 and float(m["clip_low_count"]) == 1
    assert float(m["dual_clip_count"]) == 1
    np.testing.assert_allclose(float(m["ratio_max"]), 4.0, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_min"]), 0.5, rtol=1e-6)


def test_without_dual_clip_the_large_negative_ratio_is_unbounded():
    loss_sum, _, m = _loss([np.log(4.0)], [0.0], [-0.5], [1])
    np.testing.assert_allclose(float(loss_sum), 2.0, rtol=1e-6)
    assert float(m["dual_clip_count"]) == 0


def test_all_masked_row_contributes_zero_and_no_nan():
    lp = np.array([[-np.inf, 3.0, np.nan], [-1.0, -2.0, -3.0]])
    old = np.array([[0.0, -np.inf, 1.0], [-1.5, -2.0, -2.5]])
    adv = np.array([[1.0, 1.0, 1.0], [1.0, -1.0, 1.0]])
    mask = np.array([[0, 0, 0], [1, 1, 1]])
    loss_sum, count, m = _loss(lp, old, adv, mask, sampler_logprobs=jnp.zeros((2, 3)))
    alone, count_alone, _ = _loss(lp[1:], old[1:], adv[1:], mask[1:])
    assert float(count) == 3
    np.testing.assert_allclose(float(loss_sum), float(alone), rtol=1e-6)
    grad = jax.grad(lambda x: _loss(x, old, adv, mask)[0])(jnp.asarray(lp, jnp.float32))
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[0] == 0)
    assert all(np.isfinite(float(v)) for v in m.values())


def _numpy_loss_and_grad(lp, old, adv, mask, lo, hi, c):
    """Independent re-derivation: the per-token loss and d loss_sum / d logprob."""
    r = np.exp(np.clip(lp - old, -20, 20))
    unclipped = -adv * r
    clipped = -adv * np.clip(r, 1 - lo, 1 + hi)
    use_unclipped = unclipped >= clipped
    per = np.where(use_unclipped, unclipped, clipped)
    # d/dlp of -A*r is -A*r; of the clipped branch it is -A*r inside the range, else 0.
    inside = (r > 1 - lo) & (r < 1 + hi)
    grad = np.where(use_unclipped, -adv * r, np.where(inside, -adv * r, 0.0))
    if c is not None:
        bound = -adv * c
        dual = (adv < 0) & (per > bound)
        per = np.where(dual, bound, per)
        grad = np.where(dual, 0.0, grad)
    return float((per * mask).sum()), grad * mask


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_matches_numpy_rederivation_on_random_inputs(dual_clip):
    rng = np.random.default_rng(0)
    shape = (4, 64)
    old = rng.normal(-2.0, 1.0, shape)
    lp = old + rng.normal(0.0, 0.6, shape)  # ratios spread over every branch
    adv = rng.normal(0.0, 1.0, shape)
    mask = (rng.random(shape) < 0.8).astype(np.float64)
    ref_loss, ref_grad = _numpy_loss_and_grad(lp, old, adv, mask, 0.2, 0.28, dual_clip)
    fn = lambda x: _loss(x, old, adv, mask, dual_clip=dual_clip)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(lp, jnp.float32))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-5)


def test_metrics_combine_exactly_across_micro_batches():
    rng = np.random.default_rng(1)
    lp, old, adv = rng.normal(size=(3, 2, 16))
    mask = (rng.random((2, 16)) < 0.7).astype(np.float64)
    kw = dict(sampler_logprobs=jnp.asarray(lp + 0.1, jnp.float32), entropy=jnp.ones((2, 16)))
    _, _, whole = _loss(lp, old, adv, mask, **kw)
    parts = [_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                   sampler_logprobs=kw["sampler_logprobs"][i:i + 1], entropy=kw["entropy"][i:i + 1])[2] for i in range(2)]
    merged = combine_metrics(parts[0], parts[1])
    for k in whole:
        np.testing.assert_allclose(float(merged[k]), float(whole[k]), rtol=1e-5, err_msg=k)
    final = finalize_metrics(merged)
    np.testing.assert_allclose(final["drift/logprob_abs_mean"], 0.1, rtol=1e-4)
    np.testing.assert_allclose(final["entropy/mean"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("rows, length", [(3, 5), (4, 4)], ids=["B!=T", "B==T"])
def test_advantages_per_sequence_apply_to_each_of_its_tokens(rows, length):
    """`group_advantages` gives one advantage per rollout ([B]); with B == T a plain broadcast would
    silently spread them along the sequence instead."""
    rng = np.random.default_rng(0)
    logprobs, old = (rng.standard_normal((rows, length)).astype(np.float32) for _ in range(2))
    mask = rng.integers(0, 2, (rows, length)).astype(np.float32)
    per_sequence = rng.standard_normal(rows).astype(np.float32)
    per_token = np.repeat(per_sequence[:, None], length, axis=1)
    got = grpo_loss(logprobs, old, per_sequence, mask)
    want = grpo_loss(logprobs, old, per_token, mask)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    with pytest.raises(ValueError, match=r"grpo_loss: advantages of shape \(2, 3\) fit neither"):
        grpo_loss(logprobs, old, np.zeros((2, 3), np.float32), mask)


def test_metrics_without_a_denominator_are_absent_not_zero():
    """No masked token: only the count; no entropy or sampler given: no entropy or drift figures."""
    _, count, m = _loss([0.1, 0.2], [0.0, 0.0], [1.0, -1.0], [0, 0])
    assert float(count) == 0 and finalize_metrics(m) == {"loss/tokens": 0.0}
    _, _, m = _loss([0.1, 0.2], [0.0, 0.0], [1.0, -1.0], [1, 1])
    figures = finalize_metrics(m)
    assert not {"entropy_sum", "drift_abs_sum", "drift_max"} & set(m)
    assert not {"entropy/mean", "drift/logprob_abs_mean", "drift/logprob_abs_max"} & set(figures)
    assert figures["loss/tokens"] == 2 and figures["ratio/max"] == pytest.approx(np.exp(0.2), rel=1e-6)
    _, _, m = _loss([0.1, 0.2], [0.0, 0.0], [1.0, -1.0], [1, 1], entropy=jnp.array([1.0, 3.0]),
                    sampler_logprobs=jnp.array([0.0, 0.0]))
    figures = finalize_metrics(m)
    assert figures["entropy/mean"] == pytest.approx(2.0)
    assert figures["drift/logprob_abs_mean"] == pytest.approx(0.15) and figures["drift/logprob_abs_max"] == pytest.approx(0.2)
