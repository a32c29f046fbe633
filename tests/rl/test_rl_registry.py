"""Policy losses and advantage estimators by name: a registered variant drives the real train step,
unknown names fail clearly, and the registered defaults are grpo_loss and group_advantages exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.config import REPO_CONFIGS, load_config_file, resolve
from rstar_jax.errors import ConfigError, UserError
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rl import (
    LossConfig, get_advantage_estimator, get_policy_loss, group_advantages, grpo_loss, register_advantage_estimator,
    register_policy_loss,
)
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.rl_batch import BatchConfig, prepare_batch
from rstar_jax.train.step import OptimizerConfig, make_optimizer, train_step

CONFIG = Qwen3Config.tiny()
CALLS = []  # (settings, extras) of each trace of the test loss


@register_policy_loss("test_half_grpo")
def half_grpo(settings, logprobs, old_logprobs, advantages, loss_mask, **extras):
    """GRPO at half weight: the same metrics, half the loss and gradient."""
    CALLS.append((settings, sorted(extras)))
    loss_sum, count, metrics = get_policy_loss("grpo")(settings, logprobs, old_logprobs, advantages, loss_mask,
                                                       **extras)
    return 0.5 * loss_sum, count, metrics


@register_advantage_estimator("test_sign_only")
def sign_only(rewards, group_ids):
    return np.sign(group_advantages(rewards, group_ids)).astype(np.float32)


def _random_inputs(seed, shape=(3, 17)):
    rng = np.random.default_rng(seed)
    old = rng.normal(-3.0, 1.0, shape).astype(np.float32)
    logprobs = (old + rng.normal(0.0, 0.4, shape)).astype(np.float32)
    logprobs[rng.random(shape) < 0.1] = -np.inf  # masked positions may hold anything
    mask = (rng.random(shape) < 0.7).astype(np.float32)
    mask[np.isinf(logprobs)] = 0
    return dict(logprobs=jnp.asarray(logprobs), old_logprobs=jnp.asarray(old),
                advantages=jnp.asarray(rng.normal(0.0, 1.0, shape[:-1] + (1,)).astype(np.float32)),
                loss_mask=jnp.asarray(mask), entropy=jnp.asarray(rng.random(shape).astype(np.float32)),
                sampler_logprobs=jnp.asarray((old + rng.normal(0.0, 0.05, shape)).astype(np.float32)))


@pytest.mark.parametrize("settings", [
    LossConfig(), LossConfig(dual_clip=3.0, entropy_coef=0.01),
    LossConfig(clip_low=0.1, clip_high=0.5, log_ratio_clamp=1.0)])
def test_registered_default_is_grpo_loss_bit_for_bit(settings):
    assert settings.policy_loss == "grpo" and settings.advantage_estimator == "grpo"
    registered = get_policy_loss(settings.policy_loss)
    for seed in range(3):
        x = _random_inputs(seed)
        direct = grpo_loss(x["logprobs"], x["old_logprobs"], x["advantages"], x["loss_mask"],
                           clip_low=settings.clip_low, clip_high=settings.clip_high, dual_clip=settings.dual_clip,
                           log_ratio_clamp=settings.log_ratio_clamp, entropy=x["entropy"],
                           entropy_coef=settings.entropy_coef, sampler_logprobs=x["sampler_logprobs"])
        named = registered(settings, x["logprobs"], x["old_logprobs"], x["advantages"], x["loss_mask"],
                           entropy=x["entropy"], sampler_logprobs=x["sampler_logprobs"], unknown_extra=x["entropy"])
        for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(named), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # and the gradients, as the step takes them
        grad = lambda f: jax.grad(lambda lp: f(lp)[0])(x["logprobs"])  # noqa: E731
        g_direct = grad(lambda lp: grpo_loss(lp, x["old_logprobs"], x["advantages"], x["loss_mask"],
                                             clip_low=settings.clip_low, clip_high=settings.clip_high,
                                             dual_clip=settings.dual_clip, log_ratio_clamp=settings.log_ratio_clamp,
                                             entropy=x["entropy"], entropy_coef=settings.entropy_coef))
        g_named = grad(lambda lp: registered(settings, lp, x["old_logprobs"], x["advantages"], x["loss_mask"],
                                             entropy=x["entropy"]))
        np.testing.assert_array_equal(np.asarray(g_direct), np.asarray(g_named))


def test_registered_default_advantage_is_group_advantages():
    assert get_advantage_estimator("grpo") is group_advantages


def test_unknown_names_say_which_and_what_is_registered():
    with pytest.raises(UserError, match=r"unknown policy loss 'nope'; registered: .*'grpo'.*'test_half_grpo'"):
        get_policy_loss("nope")
    with pytest.raises(UserError, match=r"unknown advantage estimator 'nope'; registered: .*'grpo'"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match=r"LossConfig.policy_loss: unknown policy loss 'ppo'; registered: 'grpo'"):
        LossConfig(policy_loss="ppo")
    with pytest.raises(ValueError, match=r"LossConfig.advantage_estimator: unknown advantage estimator 'rloo'"):
        LossConfig(advantage_estimator="rloo")
    # Through a config, the error names the config field.
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.rl.policy_loss = "ppo"
    with pytest.raises(ConfigError, match=r"config.rl.policy_loss: unknown policy loss 'ppo'"):
        resolve.loss_config(config)


def test_a_name_is_bound_once():
    register_policy_loss("test_half_grpo")(half_grpo)  # the same function again: allowed
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_policy_loss("grpo")(half_grpo)
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage_estimator("grpo")(sign_only)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(4):
        p, r = int(rng.integers(3, 8)), int(rng.integers(4, 10))
        seqs.append(TrainingSequence(
            prompt_ids=rng.integers(1, CONFIG.vocab_size, p).tolist(),
            response_ids=rng.integers(1, CONFIG.vocab_size, r).tolist(), loss_mask=[1] * r,
            advantage=float(rng.normal()), old_logprobs=rng.normal(-5.0, 0.3, r).tolist()))
    return {k: jnp.asarray(v) for k, v in make_micro_batches(seqs, rows=2, row_length=24, packed=True).items()}


def _step(settings: LossConfig):
    """The metrics of one real train_step from the same model and batch."""
    model = Qwen3(CONFIG, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0))
    with jax.default_matmul_precision("highest"):
        return train_step(model, optimizer, _batch(), settings, 8, jnp.float32(1.0))


def test_a_registered_loss_is_picked_by_name_by_the_train_step():
    base = LossConfig(dual_clip=3.0)
    half = dataclasses.replace(base, policy_loss="test_half_grpo")
    CALLS.clear()
    m_grpo = _step(base)
    assert not CALLS
    m_half = _step(half)
    assert CALLS and all(settings == half for settings, _ in CALLS)  # the settings object, whole
    assert CALLS[0][1] == ["entropy", "sampler_logprobs", "segment_ids"]  # the extras the step offers
    np.testing.assert_allclose(float(m_half["loss"]), 0.5 * float(m_grpo["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_half["grad_norm"]), 0.5 * float(m_grpo["grad_norm"]), rtol=1e-5)
    assert float(m_half["token_count"]) == float(m_grpo["token_count"])
    assert float(m_half["pg_loss_sum"]) == float(m_grpo["pg_loss_sum"])


def _trajectories():
    out = []
    for group, rewards in enumerate([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]]):
        for i, reward in enumerate(rewards):
            out.append(Trajectory(group_id=group, prompt_ids=[1, 2, 3], response_ids=[4 + i, 5],
                                  loss_mask=[1, 1], reward=reward, sampler_logprobs=[-1.0, -2.0],
                                  policy_versions=[0, 0]))
    return out


def test_a_registered_advantage_estimator_is_picked_by_name_by_prepare_batch():
    roc, batch = RocConfig(group_size=4, variant="paper"), BatchConfig(rows=4, row_length=8)
    default = prepare_batch(_trajectories(), roc, batch, seed=0)
    named = prepare_batch(_trajectories(), roc, batch, seed=0, advantage_estimator=LossConfig().advantage_estimator)
    np.testing.assert_array_equal(default.advantages, named.advantages)
    signs = prepare_batch(_trajectories(), roc, batch, seed=0,
                          advantage_estimator=LossConfig(advantage_estimator="test_sign_only").advantage_estimator)
    np.testing.assert_array_equal(signs.roc.kept_indices, default.roc.kept_indices)
    np.testing.assert_array_equal(signs.advantages, np.sign(default.advantages))
    assert not np.array_equal(signs.advantages, default.advantages)
    assert set(np.unique(signs.advantages)) <= {-1.0, 0.0, 1.0}
    with pytest.raises(UserError, match="unknown advantage estimator 'nope'"):
        prepare_batch(_trajectories(), roc, batch, seed=0, advantage_estimator="nope")
