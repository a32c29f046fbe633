"""Host-side RL batch preparation: RoC, advantages over kept rollouts, micro-batch layout."""

import numpy as np
import pytest

from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.rl_batch import BatchConfig, prepare_batch, row_length_for


def _traj(group, reward, calls=1, errors=0, answers=1, turns=2, n=6, seed=0):
    rng = np.random.default_rng(seed)
    mask = [1, 1, 0, 0, 1, 1][:n]
    return Trajectory(prompt_ids=[1, 2, 3], response_ids=rng.integers(4, 50, n).tolist(), loss_mask=mask,
                      sampler_logprobs=[-1.0 * m for m in mask], policy_versions=[0] * n, reward=reward,
                      group_id=group, n_turns=turns, n_tool_calls=calls, n_tool_errors=errors, n_answer_tags=answers)


def test_prepare_batch_drops_equal_groups_and_normalises_over_kept():
    trajs = (
        [_traj(0, 1.0, seed=i) for i in range(4)]  # all correct: dropped
        + [_traj(1, r, errors=e, seed=10 + i) for i, (r, e) in enumerate([(1, 0), (1, 1), (0, 0), (0, 0)])]
    )
    prepared = prepare_batch(trajs, RocConfig(group_size=2, variant="paper"), BatchConfig(rows=2, row_length=16), seed=0)
    assert prepared.roc.dropped_all_correct == 1 and prepared.roc.groups_kept == 1
    assert len(prepared.kept) == 2
    # Paper: floor(2 * 2 / 4) = 1 negative, 1 positive; the error-free positive has weight 1/(0 + 1e-3)
    # against 1/(1 + 1e-3) (seeded draw).
    assert prepared.kept[0] is trajs[4] and prepared.kept[1] in (trajs[6], trajs[7])
    np.testing.assert_allclose(prepared.advantages, [0.5 / (np.sqrt(0.5) + 1e-6), -0.5 / (np.sqrt(0.5) + 1e-6)], rtol=1e-6)
    b = prepared.batch
    assert b["loss_mask"].sum() == sum(sum(t.loss_mask) for t in prepared.kept)
    # Advantages live exactly on the sampled target positions.
    assert np.all((b["advantages"] != 0) == (b["loss_mask"] > 0))


def test_prepare_batch_skips_a_step_with_no_signal():
    trajs = [_traj(0, 0.0, seed=i) for i in range(4)] + [_traj(1, 1.0, seed=i) for i in range(4)]
    prepared = prepare_batch(trajs, RocConfig(group_size=2), BatchConfig(rows=2, row_length=16), seed=0)
    assert prepared.skipped and prepared.roc.dropped_all_wrong == 1 and prepared.roc.dropped_all_correct == 1


def test_prepare_batch_errors_name_the_trajectory():
    bad = _traj(3, 1.0)
    bad.loss_mask = bad.loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        prepare_batch([bad], RocConfig(group_size=1), BatchConfig(rows=1, row_length=16), seed=0)
    with pytest.raises(ValueError, match="release variant needs"):
        prepare_batch([_traj(0, 1.0), _traj(0, 0.0)], RocConfig(group_size=1, variant="release"),
                      BatchConfig(rows=1, row_length=16), seed=0)
    assert row_length_for(2048, 8192) == 10240


def test_release_variant_reads_decoded_text():
    texts = {0: "no tools, <answer>\\boxed{1}</answer>", 1: "<tool_response>ok</tool_response><|im_start|>assistant x"
             "<|im_end|><answer>\\boxed{1}</answer>"}
    trajs = [_traj(0, 1.0, seed=0), _traj(0, 1.0, seed=1), _traj(0, 0.0, seed=2), _traj(0, 0.0, seed=3)]
    decoded = {tuple(trajs[0].response_ids): texts[0], tuple(trajs[1].response_ids): texts[1]}
    decode = lambda ids: decoded.get(tuple(ids), "")  # noqa: E731
    prepared = prepare_batch(trajs, RocConfig(group_size=2, variant="release", min_per_class=1),
                             BatchConfig(rows=2, row_length=16), seed=0, decode=decode)
    # Release penalties: text 0 -> 0.5 + 1.0; text 1 -> 0 + 0: the tool-using positive is kept.
    assert prepared.kept[0] is trajs[1]
