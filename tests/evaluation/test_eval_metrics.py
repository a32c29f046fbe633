import itertools
import math

import pytest

from rstar_jax.evaluation.metrics import pass_at_k, summarize


def _pass_at_k_by_enumeration(n, c, k):
    """pass@k as the fraction of k-subsets of the n samples that contain a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 2), (8, 7, 4), (4, 4, 4), (7, 1, 7)])
def test_pass_at_k_matches_subset_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k), abs=1e-12)


def test_pass_at_k_closed_form_large_n():
    # 1 - C(n-c, k)/C(n, k) with exact integers.
    n, c, k = 64, 5, 16
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k=5 exceeds"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 6, 1)


def test_summary_against_hand_computation():
    rewards = {
        "q1": [1, 1, 1, 0],  # 0.75
        "q2": [0, 0, 0, 0],  # 0.0
        "q3": [1, 0, 1, 0],  # 0.5
    }
    s = summarize(rewards, ks=(1, 2))
    assert s.avg_at_k == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    # Per-question means 0.75, 0, 0.5: mean 5/12; deviations 1/3, -5/12, 1/12.
    var = ((1 / 3) ** 2 + (5 / 12) ** 2 + (1 / 12) ** 2) / 2
    assert s.avg_at_k_stderr == pytest.approx(math.sqrt(var / 3))
    assert s.pass_at_k[1] == pytest.approx(s.avg_at_k)
    # pass@2: q1 1 - C(1,2)/C(4,2) = 1; q2 0; q3 1 - C(2,2)/C(4,2) = 5/6.
    assert s.pass_at_k[2] == pytest.approx((1 + 0 + 5 / 6) / 3)
    assert s.samples_per_question == 4 and s.num_questions == 3


def test_summary_rejects_ragged_and_non_binary():
    with pytest.raises(ValueError, match="different sample counts"):
        summarize({"a": [1, 0], "b": [1]})
    with pytest.raises(ValueError, match="non-binary"):
        summarize({"a": [0.5, 1]})
