"""The production RL step: real JaxEngine, real loop, RoC, a sharded update, weight sync.

The tool executor and scorer are test doubles here (the sandbox-backed run is the launcher's
end-to-end test); the rewards alternate within each group so RoC keeps mixed groups.
"""

import asyncio
import dataclasses
import logging

import jax
import numpy as np
import pytest
from flax import nnx

from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.config import resolve
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.rl.roc import RocConfig
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.app import builders
from rstar_jax.train import trainer as trainer_module
from rstar_jax.train.rl_batch import BatchConfig, row_length_for
from rstar_jax.train.step import OptimizerConfig, compute_logprobs, make_optimizer, place_batch
from rstar_jax.train.trainer import RLSettings, RLTrainer
from rstar_jax.train.weight_sync import EngineSync

TOK = ByteTokenizer()
CONFIG = Qwen3Config.tiny()


@dataclasses.dataclass
class _Result:
    status: str = "ok"
    stdout: str = "1\n"
    stderr: str = ""
    duration_s: float = 0.0


class NoTools:
    async def execute(self, code, stdin="", **kw):
        return _Result()


def _engine_trainer(scorer, temperature=1.0, layer_layout="stacked"):
    model = Qwen3(CONFIG, rngs=nnx.Rngs(0))
    engine = JaxEngine(model, slots=4, max_length=2048, prefill_buckets=(2048,), seed=0, layer_layout=layer_layout)
    budget = 16
    settings = RLSettings(
        rollouts_per_prompt=4,
        loop=LoopConfig(max_turns=2, response_budget=budget, temperature=temperature),
        roc=RocConfig(group_size=2, variant="paper"),
        loss=LossConfig(),
        batch=BatchConfig(rows=2, row_length=row_length_for(1900, budget), packed=False, use_sampler_logprobs=False),
        seed=0,
        chunk_size=512,
    )
    opt = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0))
    trainer = RLTrainer(model, opt, TOK, settings, executor=NoTools(), scorer=scorer, weight_sync=EngineSync(engine),
                        generator=engine)
    return trainer, engine


def _alternating():
    calls = {"n": 0}

    async def scorer(text, gold, truncated=False):
        calls["n"] += 1
        return float(calls["n"] % 2)

    return scorer


def test_step_updates_the_policy_and_syncs_the_engine():
    trainer, engine = _engine_trainer(_alternating())
    try:
        before = np.asarray(trainer.model.q_proj[...]).copy()
        metrics, trajectories = asyncio.run(trainer.astep([("What is 1+1?", "2"), ("What is 2+2?", "4")], step=0))
        assert len(trajectories) == 8 and {t.group_id for t in trajectories} == {0, 1}
        for t in trajectories:
            t.check()
            assert len(t.response_ids) <= 16 and sum(t.loss_mask) >= 1
        assert metrics["update/skipped"] == 0 and metrics["roc/rollouts_kept"] == 4
        assert np.isfinite(metrics["update/loss"]) and metrics["update/grad_norm"] > 0
        assert not np.array_equal(before, np.asarray(trainer.model.q_proj[...]))
        assert engine.version == trainer.weights_version == 1  # the engine samples from the updated policy
        # Sampler log-probs (engine, temperature 1) match the trainer's recomputation before the update.
        assert metrics["drift/logprob_abs_max"] < 1e-3
        assert metrics["rollout/retractions"] == 0  # a pool of slots x context never overflows
        assert metrics["rollout/num_trajectories"] == 8 and "rollout/truncation_ratio" in metrics
    finally:
        engine.close()


def test_a_per_layer_engine_samples_from_each_pushed_policy():
    """rollout.engine.layer_layout="per_layer": every push cuts the trained (stacked, donated by the
    next update) parameters into the engine's own per-layer arrays; two steps in a row sample,
    train and sync, and the second step's sampler log-probs match the first update's policy."""
    trainer, engine = _engine_trainer(_alternating(), layer_layout="per_layer")
    prompts = [("What is 1+1?", "2"), ("What is 2+2?", "4")]
    try:
        for step in (0, 1):
            metrics, _ = asyncio.run(trainer.astep(prompts, step=step))
            assert metrics["update/skipped"] == 0 and metrics["drift/logprob_abs_max"] < 1e-3
            assert engine.version == trainer.weights_version == step + 1
            for i, layer in enumerate(engine._weights.layers):
                for name, w in layer.items():
                    np.testing.assert_array_equal(np.asarray(w), np.asarray(getattr(trainer.model, name)[...][i]))
    finally:
        engine.close()


def test_step_without_signal_is_skipped():
    async def always_wrong(text, gold, truncated=False):
        return 0.0

    trainer, engine = _engine_trainer(always_wrong)
    try:
        metrics, _ = asyncio.run(trainer.astep([("What is 1+1?", "2")], step=0))
        assert metrics["update/skipped"] == 1 and metrics["roc/dropped_all_wrong"] == 1
        assert engine.version == 0 and "time/weight_sync_s" not in metrics
    finally:
        engine.close()


def test_log_probs_are_taken_at_the_sampling_temperature():
    """At temperature 0.7 the trainer's π_old (and π_θ before the update) equals the sampler's log-probs;
    at 1.0 they would differ by far more than the drift we see."""
    trainer, engine = _engine_trainer(_alternating(), temperature=0.7)
    try:
        metrics, trajectories = asyncio.run(trainer.astep([("What is 1+1?", "2"), ("What is 2+2?", "4")], step=0))
        assert metrics["update/skipped"] == 0
        assert metrics["drift/logprob_abs_max"] < 1e-3
        # The same tokens scored at temperature 1 (the old behaviour) drift far from the sampler's.
        fresh = Qwen3(CONFIG, rngs=nnx.Rngs(0))  # the weights that sampled
        prepared = trainer.prepare(trajectories, step=0)
        batch = place_batch(prepared.batch, None)
        at_one, _ = compute_logprobs(fresh, batch, chunk_size=512, temperature=1.0)
        mask = np.asarray(batch["loss_mask"]) > 0
        gap = np.abs(np.asarray(at_one) - np.asarray(batch["sampler_logprobs"]))[mask]
        assert gap.mean() > 0.05
    finally:
        engine.close()


# -- the production update on a mesh ----------------------------------------------------------------

def _config():
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict({
        "rollout.rollouts_per_prompt": 4, "rl.group_size": 2, "data.num_prompts_per_step": 3,
        "rollout.max_prompt_length": 32, "rollout.response_budget": 32, "rl.micro_batch_tokens": 128,
        "rl.logprob_chunk_size": 32})
    return config


def _trajectories(step: int) -> list[Trajectory]:
    """Three groups of four; how many groups RoC keeps (so how many rollouts) changes with the step."""
    rng = np.random.default_rng(step)
    patterns = [[[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]],
                [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]],  # two groups dropped
                [[1, 1, 1, 1], [0, 1, 1, 0], [1, 0, 0, 1]]][step]
    out = []
    for group, rewards in enumerate(patterns):
        for index, reward in enumerate(rewards):
            p, r = int(rng.integers(5, 30)), int(rng.integers(4, 30))
            mask = (rng.random(r) < 0.8).astype(int).tolist()
            mask[0] = 1
            out.append(Trajectory(prompt_ids=rng.integers(1, CONFIG.vocab_size, p).tolist(),
                                  response_ids=rng.integers(1, CONFIG.vocab_size, r).tolist(), loss_mask=mask,
                                  sampler_logprobs=[float(x) * m for x, m in zip(rng.normal(-5, 0.3, r), mask)],
                                  policy_versions=[0] * r, reward=float(reward), group_id=3 * step + group,
                                  sample_index=index, n_turns=1, n_tool_calls=1, n_answer_tags=1))
    return out


def _update_trainer(mesh):
    config = _config()
    model = create_sharded_model(CONFIG, mesh, seed=0)
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0))
    settings = resolve.rl_settings(config, builders.data_parallel(mesh))
    return RLTrainer(model, optimizer, TOK, settings, executor=NoTools(), scorer=None, weight_sync=None, mesh=mesh)


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling jit("):
            self.names.append(message[len("Compiling jit("):].split(")")[0])


def _params(model) -> dict[str, np.ndarray]:
    return {str(path[-1]): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _applied_gradients(optimizer) -> dict[str, np.ndarray]:
    """The (clipped) gradient of the first update: Adam's first moment is (1 - b1) x it."""
    return {str(path[-1]): np.asarray(v[...]) / 0.1 for path, v in nnx.to_flat_state(nnx.state(optimizer))
            if "mu" in path}


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_sharded_update_equals_one_device_and_compiles_once(mesh_shape, monkeypatch):
    """The trainer places every batch over the data-parallel axes, one update equals the one-device
    update, and three steps that keep different numbers of rollouts compile the step once."""
    mesh = make_mesh(*mesh_shape)
    single = _update_trainer(make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    sharded = _update_trainer(mesh)
    assert sharded.settings.batch.rows == mesh_shape[0] * mesh_shape[1] * single.settings.batch.rows
    with jax.default_matmul_precision("highest"):
        reference = single.update(_trajectories(0), step=0)

    seen = []
    real_step = trainer_module.train_step

    def recording_step(model, optimizer, batch, *args):
        seen.append({k: v.sharding for k, v in batch.items()})
        return real_step(model, optimizer, batch, *args)

    monkeypatch.setattr(trainer_module, "train_step", recording_step)
    log = _CompileLog()
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(log)
    jax.clear_caches()
    kept = []
    try:
        with jax.log_compiles(True), jax.default_matmul_precision("highest"):
            for step in range(3):
                metrics = sharded.update(_trajectories(step), step=step)
                assert metrics["update/skipped"] == 0
                kept.append(metrics["roc/rollouts_kept"])
                if step == 0:
                    first = metrics, _params(sharded.model), _applied_gradients(sharded.optimizer)
    finally:
        logger.removeHandler(log)
    assert len(set(kept)) == 3, kept  # three different batches ...
    assert log.names.count("_train_step") == 1, log.names  # ... one compilation
    assert log.names.count("compute_logprobs") == 1, log.names
    data_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, data_axes, None))
    assert len(seen) == 3
    for shardings in seen:
        for name, sharding in shardings.items():
            assert sharding.is_equivalent_to(expected, 3), (name, sharding)
    # One update from the same trajectories equals the one-device update: the same loss, gradient
    # and parameters. Adam's first step moves a weight by lr x sign(gradient), so where a gradient
    # is float noise around zero (|g| < 1e-6) reduction order decides the sign: those weights are
    # compared through their gradient only.
    metrics, params, grads = first
    for key in ("update/loss", "update/grad_norm", "loss/tokens", "drift/logprob_abs_mean"):
        np.testing.assert_allclose(metrics[key], reference[key], rtol=1e-5, atol=1e-7, err_msg=key)
    reference_grads = _applied_gradients(single.optimizer)
    for name, a in _params(single.model).items():
        np.testing.assert_allclose(grads[name], reference_grads[name], atol=1e-5, err_msg=name)
        signal = np.abs(reference_grads[name]) > 1e-6
        np.testing.assert_allclose(params[name][signal], a[signal], atol=1e-5, err_msg=name)
