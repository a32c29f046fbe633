"""Resample-on-Correct (both variants) and group advantages."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar_jax.agent.stats import release_counts
from rstar_jax.rl import RocConfig, group_advantages, paper_penalty, release_penalty, resample_on_correct


def release_penalty_from_text(texts):
    counts = [release_counts(t) for t in texts]
    return release_penalty(**{k: [c[k] for c in counts] for k in counts[0]})


@st.composite
def batches(draw):
    n_groups = draw(st.integers(1, 6))
    size = draw(st.sampled_from([4, 8, 32]))
    rewards, groups, penalties = [], [], []
    for g in range(n_groups):
        n_pos = draw(st.integers(0, size))
        r = [1.0] * n_pos + [0.0] * (size - n_pos)
        r = draw(st.permutations(r))
        rewards += r
        groups += [g] * size
        penalties += draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0]), min_size=size, max_size=size))
    return np.array(rewards), np.array(groups), np.array(penalties), size


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["paper", "release"]), st.integers(0, 3))
def test_roc_properties(batch, variant, seed):
    rewards, groups, penalties, size = batch
    g = size // 2
    config = RocConfig(group_size=g, variant=variant)
    result = resample_on_correct(rewards, groups, penalties, config, seed=seed)
    kept = result.kept_indices
    assert len(set(kept.tolist())) == len(kept)
    n_groups = len(np.unique(groups))
    all_correct = sum(np.all(rewards[groups == k] > 0) for k in range(n_groups))
    all_wrong = sum(np.all(rewards[groups == k] <= 0) for k in range(n_groups))
    assert result.dropped_all_correct == all_correct and result.dropped_all_wrong == all_wrong
    assert result.groups_kept == n_groups - all_correct - all_wrong
    for k in np.unique(groups[kept]):
        members = kept[groups[kept] == k]
        assert len(members) == g  # every surviving group keeps exactly G
        r = rewards[members]
        if variant == "release" and g >= 4:
            assert not np.all(r == r[0])  # the minimum of 2 per class keeps groups mixed
        if variant == "release":
            pos_all = np.flatnonzero((groups == k) & (rewards > 0))
            kept_pos = members[rewards[members] > 0]
            # Lowest penalty first: no discarded positive has a lower penalty than a kept one.
            discarded = np.setdiff1d(pos_all, kept_pos)
            if len(kept_pos) and len(discarded):
                assert penalties[discarded].min() >= penalties[kept_pos].max()
    # Determinism under a seed.
    again = resample_on_correct(rewards, groups, penalties, config, seed=seed)
    np.testing.assert_array_equal(again.kept_indices, kept)


def test_release_worked_consequences():
    # 32 rollouts: 20 positives, 12 negatives -> neg_k = round(6.0) = 6, pos_k = round(10.0) = 10.
    rewards = np.array([1.0] * 20 + [0.0] * 12)
    penalties = np.concatenate([np.linspace(2.0, 0.0, 20), np.zeros(12)])
    res = resample_on_correct(rewards, np.zeros(32, int), penalties, RocConfig(16, "release"), seed=0)
    kept = res.kept_indices
    assert (rewards[kept] > 0).sum() == 10 and (rewards[kept] == 0).sum() == 6
    assert set(kept[rewards[kept] == 0]) == set(range(20, 26))  # first negatives in rollout order
    assert set(kept[rewards[kept] > 0]) == set(range(10, 20))  # the ten lowest penalties
    # One positive of 32: pos_k = round(0.5) = 0 -> minimum min(2, 1) = 1, neg_k = 15.
    rewards = np.array([1.0] + [0.0] * 31)
    res = resample_on_correct(rewards, np.zeros(32, int), np.zeros(32), RocConfig(16, "release"), seed=0)
    assert (rewards[res.kept_indices] > 0).sum() == 1 and len(res.kept_indices) == 16
    # Banker's rounding: 3 negatives -> 1.5 -> 2 (even); 29 positives -> 14.5 -> 14.
    rewards = np.array([1.0] * 29 + [0.0] * 3)
    res = resample_on_correct(rewards, np.zeros(32, int), np.zeros(32), RocConfig(16, "release"), seed=0)
    assert (rewards[res.kept_indices] == 0).sum() == 2
    # A group smaller than G is dropped by the release.
    res = resample_on_correct(np.array([1.0, 0.0]), np.zeros(2, int), np.zeros(2), RocConfig(16, "release"), seed=0)
    assert res.dropped_too_small == 1 and len(res.kept_indices) == 0


def test_release_text_penalties_follow_the_spec():
    # A correct single-turn answer without tools: p_err 0.5 (no tool responses), p_format 1.0
    # (no later assistant turn is visible in the response text) -> 1.5.
    single = "I think. </reason><answer>\\boxed{3}</answer><|im_end|>"
    assert release_penalty_from_text([single])[0] == pytest.approx(1.5)
    # One tool call then the answer: p_err 0, p_format min((1-1)/1, 1) = 0 -> 0.
    two = ('<tool_call>{"name": "python", "arguments": {"code": "print(3)"}}</tool_call><|im_end|>'
           "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
           "So 3.</reason><answer>\\boxed{3}</answer><|im_end|>")
    assert release_penalty_from_text([two])[0] == pytest.approx(0.0)
    # The substring rule: an output that prints "error" counts as an error; a timeout text does not.
    printed = two.replace("\n3\n</tool_response>", "\nno error here\n</tool_response>")
    assert release_penalty_from_text([printed])[0] == pytest.approx(1.0)
    timeout = two.replace("\n3\n</tool_response>", "\nTool call failure\nreason: worker_timeout\n</tool_response>")
    assert release_counts(timeout)["n_error_responses"] == 0


def test_paper_penalty_and_selection_weights():
    p = paper_penalty([0, 2, 4, 1], [0, 1, 0, 1], [1, 1, 2, 0], [1, 2, 4, 3])
    np.testing.assert_allclose(p, [0.5 + 0.0, 0.5 + 0.0, 0.0 + 0.25, 1.0 + 1.0])
    with pytest.raises(ValueError, match="more tool errors"):
        paper_penalty([1], [2], [1], [1])
    # Paper variant at n = 2G: floor(n_neg / 2) negatives; penalty-0 positives dominate the draw.
    rewards = np.array([1.0] * 10 + [0.0] * 6)
    penalties = np.array([0.0] * 5 + [2.0] * 5 + [0.0] * 6)
    hits = np.zeros(16)
    for seed in range(200):
        res = resample_on_correct(rewards, np.zeros(16, int), penalties, RocConfig(8, "paper"), seed=seed)
        assert (rewards[res.kept_indices] == 0).sum() == 3
        hits[res.kept_indices] += 1
    assert hits[:5].min() > 190 and hits[5:10].max() < 10  # weight 1/(0+1e-3) vs 1/(2+1e-3)


def test_paper_variant_one_negative_options():
    # One negative among 2G = 32: the paper's floor(1/2) = 0 negatives leaves 16 equal rewards.
    rewards = np.array([1.0] * 31 + [0.0])
    groups, penalties = np.zeros(32, int), np.zeros(32)
    literal = resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper"), seed=0)
    assert len(literal.kept_indices) == 16 and np.all(rewards[literal.kept_indices] == 1.0)
    assert literal.zero_advantage_groups == 1 and literal.dropped_zero_advantage == 0
    assert np.all(group_advantages(rewards[literal.kept_indices], groups[:16]) == 0)
    with_negative = resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper", min_negatives=1), seed=0)
    assert 31 in with_negative.kept_indices and len(with_negative.kept_indices) == 16
    assert with_negative.zero_advantage_groups == 0
    # Dropped: the group's tokens leave the batch, so they no longer dilute the token mean.
    mixed = np.concatenate([rewards, [1.0] * 16 + [0.0] * 16])
    dropped = resample_on_correct(mixed, np.repeat([0, 1], 32), np.zeros(64), RocConfig(16, "paper",
                                                                                       zero_advantage="drop"),
                                  seed=0)
    assert dropped.dropped_zero_advantage == 1 and set(dropped.kept_indices.tolist()) <= set(range(32, 64))
    assert len(dropped.kept_indices) == 16 and dropped.stats()["roc/dropped_zero_advantage"] == 1
    # The minimum never exceeds the negatives there are, and the floor still applies above it.
    few = resample_on_correct(np.array([1.0] * 20 + [0.0] * 12), groups, penalties,
                              RocConfig(16, "paper", min_negatives=2), seed=0)
    assert (np.array([1.0] * 20 + [0.0] * 12)[few.kept_indices] == 0).sum() == 6
    with pytest.raises(ValueError, match="min_negatives"):
        RocConfig(16, "paper", min_negatives=17)
    with pytest.raises(ValueError, match="zero_advantage"):
        RocConfig(16, "paper", zero_advantage="skip")


def test_roc_input_errors():
    with pytest.raises(ValueError, match="equal 1-D"):
        resample_on_correct([1, 0], [0], [0, 0], seed=0)
    with pytest.raises(ValueError, match="variant"):
        RocConfig(variant="dapo")


def test_group_advantages_by_hand():
    rewards = np.array([1, 0, 0, 1, 1, 0, 1])
    groups = np.array([0, 0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    std0 = np.std([1, 0, 0, 1], ddof=1)  # 0.57735
    np.testing.assert_allclose(adv[:4], (np.array([1, 0, 0, 1]) - 0.5) / (std0 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(adv[4:6], [0.5 / (np.sqrt(0.5) + 1e-6), -0.5 / (np.sqrt(0.5) + 1e-6)], rtol=1e-6)
    assert adv[6] == 0.0  # a group of one


def test_the_draw_takes_its_seed_per_call():
    """No silent fixed seed: a call must say how it draws, and different seeds draw differently."""
    rewards = np.array([1.0] * 20 + [0.0] * 12)
    groups, penalties = np.zeros(32, int), np.full(32, 0.5)
    with pytest.raises(TypeError, match="seed"):
        resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper"))
    assert "seed" not in {f.name for f in dataclasses.fields(RocConfig)}
    draws = {tuple(resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper"), seed=(7, step)).kept_indices)
             for step in range(8)}
    assert len(draws) > 1
    generator = resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper"),
                                    seed=np.random.default_rng(3)).kept_indices
    np.testing.assert_array_equal(generator, resample_on_correct(rewards, groups, penalties, RocConfig(16, "paper"),
                                                                 seed=3).kept_indices)
