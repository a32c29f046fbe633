"""Every objective variant through the real jitted update: packed micro-batches, one compile per run,
the step's loss divided by the variant's own denominator, and the ahead-of-time compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rl import LossConfig, finalize_metrics
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.step import OptimizerConfig, make_optimizer, train_step

CONFIG = Qwen3Config.tiny()
VARIANTS = {
    "token-mean": LossConfig(),
    "seq-mean-token-mean": LossConfig(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum": LossConfig(loss_agg_mode="seq-mean-token-sum"),
    "dr-grpo": LossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16.0),
    "gspo": LossConfig(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", dual_clip=None),
    "token-is": LossConfig(dual_clip=3.0, rollout_is="token", rollout_is_threshold=1.5),
    "sequence-is-token-rs": LossConfig(rollout_is="sequence", rollout_rs="token", rollout_rs_threshold=1.3),
    "geometric-rs": LossConfig(rollout_rs="geometric", rollout_rs_threshold=1.02, rollout_rs_threshold_lower=0.0),
}


def _batch(seed):
    """Two micro-batches of packed rows; the sampler's log-probs differ from π_old's, as a bf16
    sampler's do, so that truncation and rejection have something to act on."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(6):
        p, r = int(rng.integers(3, 6)), int(rng.integers(3, 8))
        old = rng.normal(-5.0, 0.3, r)
        seqs.append(TrainingSequence(
            prompt_ids=rng.integers(1, CONFIG.vocab_size, p).tolist(),
            response_ids=rng.integers(1, CONFIG.vocab_size, r).tolist(), loss_mask=[1] * r,
            advantage=float(rng.normal()), old_logprobs=old.tolist(),
            sampler_logprobs=(old + rng.normal(0.0, 0.4, r)).tolist()))
    batch = make_micro_batches(seqs, rows=2, row_length=24, packed=True, num_micro_batches=3)
    return {k: jnp.asarray(v) for k, v in batch.items()}


class _Compiles:
    """Counts XLA backend compilations while active (a public monitoring event)."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = _Compiles()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_trains_in_the_step_and_compiles_once(name):
    settings = VARIANTS[name]
    model = Qwen3(CONFIG, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0))
    first = jax.device_get(train_step(model, optimizer, _batch(0), settings, 8, jnp.float32(1.0)))
    COMPILES.count, COMPILES.active = 0, True
    try:
        second = jax.device_get(train_step(model, optimizer, _batch(1), settings, 8, jnp.float32(1.0)))
    finally:
        COMPILES.active = False
    assert COMPILES.count == 0, f"{name}: the second step compiled again"
    for metrics in (first, second):
        assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        # The step divides the summed numerators once, by the variant's own denominator.
        np.testing.assert_allclose(metrics["loss"], metrics["loss_sum"] / metrics["loss_denominator"], rtol=1e-6)
        figures = finalize_metrics(metrics)
        assert figures["mismatch/kl_k3"] > 0  # the sampler differs from π_old
    denominator = second["loss_denominator"]
    if settings.loss_agg_mode == "token-mean":
        assert denominator == second["token_count"]
    else:
        assert denominator == second["sequence_count"] and denominator <= 6
    figures = finalize_metrics(second)
    if settings.rollout_is:
        assert 0 < figures["rollout_is/weight_mean"]
        assert figures["rollout_is/truncated_frac"] > 0 or settings.rollout_is == "sequence"
    if settings.rollout_rs:
        assert 0 < figures["rollout_rs/token_frac"] < 1
        assert figures["loss/tokens"] < second["sampled_token_count"]


def test_the_ahead_of_time_compile_takes_a_variant():
    from rstar_jax.app.aot import abstract_policy, compile_grpo_update
    from rstar_jax.config import REPO_CONFIGS, load_config_file
    from rstar_jax.parallel import make_mesh

    config = load_config_file(str(REPO_CONFIGS / "tiny.py"))
    mesh = make_mesh(data=2, fsdp=4, tensor=1)
    model_state, opt_state = abstract_policy(config, mesh)
    variant = LossConfig(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", dual_clip=None,
                         rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=2.0)
    step = compile_grpo_update(model_state, opt_state, mesh, 2, 8, 64, variant, 32, 1.0)
    assert step.argument_bytes > 0
