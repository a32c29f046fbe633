"""The GRPO train step: micro-batch / packing invariance, sharded == single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.step import OptimizerConfig, compute_logprobs, loss_and_grads, make_optimizer, place_batch, train_step

CONFIG = Qwen3Config.tiny()
LOSS = LossConfig(dual_clip=3.0)


def _sequences(n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 8)), int(rng.integers(4, 12))
        mask = (rng.random(r) < 0.8).astype(int)
        out.append(TrainingSequence(
            prompt_ids=rng.integers(1, CONFIG.vocab_size, p).tolist(),
            response_ids=rng.integers(1, CONFIG.vocab_size, r).tolist(),
            loss_mask=mask.tolist(),
            advantage=float(rng.normal()),
            old_logprobs=(rng.normal(-5.0, 0.3, r)).tolist(),
        ))
    return out


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


def _grads(model, batch):
    with jax.default_matmul_precision("highest"):
        fn = nnx.jit(lambda m, b: loss_and_grads(m, b, LOSS, chunk_size=8))
        loss, grads, metrics = fn(model, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(loss), grads, metrics


def test_batching_aligns_masks_to_targets():
    seq = TrainingSequence([5, 6, 7], [8, 9, 10], [1, 0, 1], 0.5, [-1.0, -2.0, -3.0])
    b = make_micro_batches([seq], rows=1, row_length=8, packed=False)
    assert b["input_ids"][0, 0, :5].tolist() == [5, 6, 7, 8, 9]
    assert b["targets"][0, 0, :5].tolist() == [6, 7, 8, 9, 10]
    assert b["loss_mask"][0, 0, :6].tolist() == [0, 0, 1, 0, 1, 0]  # target 8 and 10 were sampled
    assert b["old_logprobs"][0, 0, :5].tolist() == [0, 0, -1, -2, -3]
    assert b["advantages"][0, 0, :5].tolist() == [0, 0, 0.5, 0, 0.5]
    with pytest.raises(ValueError, match="more than row_length"):
        make_micro_batches([seq], rows=1, row_length=4)


def test_one_batch_micro_batches_and_packing_agree(model):
    seqs = _sequences()
    whole = make_micro_batches(seqs, rows=6, row_length=24, packed=False)
    micro = make_micro_batches(seqs, rows=2, row_length=24, packed=False)
    packed = make_micro_batches(seqs, rows=2, row_length=24, packed=True)
    assert whole["input_ids"].shape[0] == 1 and micro["input_ids"].shape[0] == 3
    assert packed["input_ids"].shape[0] < 3 and packed["segment_ids"].max() > 1
    loss_w, grads_w, m_w = _grads(model, whole)
    for other in (micro, packed):
        loss_o, grads_o, m_o = _grads(model, other)
        assert float(m_o["token_count"]) == float(m_w["token_count"])
        np.testing.assert_allclose(loss_o, loss_w, rtol=1e-5)
        for (path, a), (_, b) in zip(nnx.to_flat_state(grads_w), nnx.to_flat_state(grads_o)):
            np.testing.assert_allclose(b[...], a[...], atol=1e-6, rtol=1e-4, err_msg=str(path))


def test_empty_padding_micro_batches_change_nothing(model):
    seqs = _sequences(4, seed=1)
    base = make_micro_batches(seqs, rows=2, row_length=24, packed=True)
    padded = make_micro_batches(seqs, rows=2, row_length=24, packed=True, num_micro_batches=4)
    assert padded["input_ids"].shape[0] == 4 and base["input_ids"].shape[0] < 4
    loss_a, grads_a, m_a = _grads(model, base)
    loss_b, grads_b, m_b = _grads(model, padded)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for key in m_a:  # sums, maxima and minima alike: skipped micro-batches are the identity
        np.testing.assert_allclose(float(m_b[key]), float(m_a[key]), rtol=1e-6, err_msg=key)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads_a), nnx.to_flat_state(grads_b)):
        np.testing.assert_allclose(b[...], a[...], atol=1e-7, err_msg=str(path))
    with pytest.raises(ValueError, match="more than num_micro_batches"):
        make_micro_batches(seqs, rows=1, row_length=24, packed=False, num_micro_batches=2)


def _run_step(model, batch, mesh=None):
    opt = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0))
    batch = place_batch(batch, mesh)
    with jax.default_matmul_precision("highest"):
        metrics = train_step(model, opt, batch, LOSS, 8, 1.0)
    return model, metrics


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
def test_sharded_train_step_equals_single_device(mesh_shape):
    batch = make_micro_batches(_sequences(8, seed=2), rows=8, row_length=24, packed=False)
    single, m1 = _run_step(Qwen3(CONFIG, rngs=nnx.Rngs(0)), batch)
    mesh = make_mesh(*mesh_shape)
    sharded, mn = _run_step(create_sharded_model(CONFIG, mesh, seed=0), batch, mesh)
    np.testing.assert_allclose(float(mn["loss"]), float(m1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(mn["grad_norm"]), float(m1["grad_norm"]), rtol=1e-4)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(single, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(sharded, nnx.Param))):
        # Adam divides by sqrt(v): reduction-order noise in near-zero gradients moves a weight by < 1e-5.
        np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), atol=1e-5, err_msg=str(path))
    expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, "fsdp", "tensor" if mesh_shape[2] > 1 else None, None))
    assert sharded.q_proj[...].sharding.is_equivalent_to(expected, 4)  # still sharded after the update


def test_step_learns_and_ratio_is_one_on_policy(model):
    """With old log-probs recomputed from the current policy, ratios are 1 and the loss falls."""
    m = Qwen3(CONFIG, rngs=nnx.Rngs(1))
    seqs = _sequences(4, seed=3)
    batch = make_micro_batches(seqs, rows=4, row_length=24, packed=False)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    logp, _ = compute_logprobs(m, jb, chunk_size=8)
    jb["old_logprobs"] = jnp.where(jb["loss_mask"] > 0, logp, 0.0)
    opt = make_optimizer(m, OptimizerConfig(lr=1e-2, warmup_steps=0))
    first = train_step(m, opt, jb, LOSS, 8, 1.0)
    np.testing.assert_allclose(float(first["ratio_sum"]) / float(first["token_count"]), 1.0, rtol=1e-5)
    assert float(first["clip_low_count"]) == 0 and float(first["clip_high_count"]) == 0
    losses = [float(first["loss"])]
    for _ in range(3):
        losses.append(float(train_step(m, opt, jb, LOSS, 8, 1.0)["loss"]))
    assert losses[-1] < losses[0]


def test_lr_schedules_by_hand():
    """Linear warm-up, then constant, cosine over the rest, or constant until the last decay_ratio of
    the steps and a cosine from there ("wsd")."""
    import math

    from rstar_jax.train.step import lr_schedule

    cosine = lr_schedule(OptimizerConfig(lr=1.0, warmup_steps=10, schedule="cosine", total_steps=110))
    wsd = lr_schedule(OptimizerConfig(lr=1.0, warmup_steps=10, schedule="wsd", total_steps=110, decay_ratio=0.2))
    constant = lr_schedule(OptimizerConfig(lr=1.0, warmup_steps=10))
    for step in (0, 5, 10):
        assert float(cosine(step)) == float(wsd(step)) == float(constant(step)) == pytest.approx(step / 10)
    for step in (10, 40, 60, 88, 110):
        assert float(cosine(step)) == pytest.approx(0.5 * (1 + math.cos(math.pi * (step - 10) / 100)), abs=1e-6)
        expected = 1.0 if step <= 88 else 0.5 * (1 + math.cos(math.pi * (step - 88) / 22))
        assert float(wsd(step)) == pytest.approx(expected, abs=1e-6), step
        assert float(constant(step)) == 1.0
    with pytest.raises(ValueError, match="decay_ratio must be in"):
        OptimizerConfig(schedule="wsd", total_steps=100, decay_ratio=0.0)
