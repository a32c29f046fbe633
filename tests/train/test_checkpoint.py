"""Checkpoint round trips with the real tiny Qwen3 sharded over 8 fake devices and AdamW state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.model.qwen3 import Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.train.checkpoint import Checkpointer, CheckpointError

MESH_SHAPE = (1, 4, 2)  # data, fsdp, tensor: every parameter kind is split somewhere


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(*MESH_SHAPE)


def _model_and_optimizer(mesh, seed):
    model = create_sharded_model(Qwen3Config.tiny(), mesh, seed=seed)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, optimizer


@nnx.jit
def _fake_update(model, optimizer):
    # Deterministic non-zero "gradients" so the Adam moments and count are non-trivial.
    grads = jax.tree.map(lambda p: jnp.sin(p) + 0.5, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)


def _leaves(obj):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(obj))]


def _shardings(obj):
    return [x.sharding for x in jax.tree.leaves(nnx.state(obj))]


def test_save_restore_bitwise_and_sharded(mesh, tmp_path):
    model, optimizer = _model_and_optimizer(mesh, seed=0)
    _fake_update(model, optimizer)
    _fake_update(model, optimizer)
    key = jax.random.key(7)
    data_state = {"iterator": {"next_index": 5}, "num_examples": 40}
    exported = []
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2, async_save=True, export_every=2,
                      export_hf=lambda step, path, _: exported.append((step, path.name))) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(2, model=model, optimizer=optimizer, rng=key, data_state=data_state, stage="stage1",
                         config={"rl": {"clip_high": 0.28}})
        assert ckpt.save(3, model=model)  # a later step without optimizer state (export: 3 % 2 != 0)
    assert exported == [(2, "step_2")]

    # A different initialisation, restored in place, must match bitwise and keep its shardings.
    fresh_model, fresh_opt = _model_and_optimizer(mesh, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(model), _leaves(fresh_model)))
    shardings_before = _shardings(fresh_model) + _shardings(fresh_opt)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 3
        restored = ckpt.restore(2, model=fresh_model, optimizer=fresh_opt)
    assert restored.step == 2 and restored.stage == "stage1" and restored.optimizer_restored
    assert restored.data_state == data_state
    assert restored.config == {"rl": {"clip_high": 0.28}}
    assert np.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(key))
    for a, b in zip(_leaves(model) + _leaves(optimizer), _leaves(fresh_model) + _leaves(fresh_opt)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert _shardings(fresh_model) + _shardings(fresh_opt) == shardings_before
    embed = fresh_model.embed[...]
    assert len(embed.sharding.device_set) == 8 and embed.addressable_shards[0].data.size < embed.size


def test_reset_optimizer_max_to_keep_and_errors(mesh, tmp_path):
    model, optimizer = _model_and_optimizer(mesh, seed=0)
    _fake_update(model, optimizer)
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2, save_every=2, async_save=False) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, model=model, optimizer=optimizer)
        assert ckpt.all_steps() == [4, 6]  # multiples of 2, the last two kept
        with pytest.raises(CheckpointError, match="no checkpoint for step 3"):
            ckpt.restore(3, model=model)
        ckpt.save(7, model=model, force=True)  # forced, and without optimizer state
        with pytest.raises(CheckpointError, match="has no optimizer state"):
            ckpt.restore(model=model, optimizer=optimizer)

    fresh_model, fresh_opt = _model_and_optimizer(mesh, seed=1)
    fresh_moments = _leaves(fresh_opt)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(6, model=fresh_model, optimizer=fresh_opt, reset_optimizer=True)
    assert not restored.optimizer_restored and restored.rng is None
    for a, b in zip(_leaves(model), _leaves(fresh_model)):
        assert np.array_equal(a, b)
    for a, b in zip(fresh_moments, _leaves(fresh_opt)):  # untouched: a fresh optimizer
        assert np.array_equal(a, b)

    with Checkpointer(tmp_path / "empty") as ckpt, pytest.raises(CheckpointError, match="no checkpoint in"):
        ckpt.restore(model=model)

    from rstar_jax.config import REPO_CONFIGS, load_config_file
    from rstar_jax.app import builders

    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict({"run_dir": str(tmp_path / "run"), "checkpoint.every_steps": 2,
                                       "checkpoint.export_hf_every": 3})
    with builders.checkpointer(config, model, ByteTokenizer()) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, model=model)
        assert ckpt.all_steps() == [4, 6]  # every 2 steps, keep 2 (tiny)
    # Saves on multiples of 2, HF exports on those of 3 too: step 6 only.
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["step_6"]
    assert (tmp_path / "run" / "hf" / "step_6" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_restore_into_abstract_targets_and_mismatch(mesh, tmp_path):
    model, _ = _model_and_optimizer(mesh, seed=0)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, model=model, rng=jnp.arange(2, dtype=jnp.uint32))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            nnx.to_pure_dict(nnx.state(model)))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(model=abstract)
        assert np.array_equal(np.asarray(restored.rng), [0, 1])
        for a, b in zip(jax.tree.leaves(restored.model_state), _leaves(model)):
            assert np.array_equal(np.asarray(a), b)
        other = create_sharded_model(Qwen3Config.tiny(num_layers=1), mesh, seed=0)
        with pytest.raises(CheckpointError, match=r"tensor (\S+) has shape \(2, .*\) in the checkpoint, \(1, "):
            ckpt.restore(model=other)


def test_resume_continues_exactly_with_data_and_rng(tmp_path):
    """Train a stand-in model on the prompt stream, checkpoint at step k, resume in fresh objects:
    the same batches, RNG draws and parameters as the uninterrupted run at step k+n."""
    from rstar_jax.data import PromptIterator, generate_problems, load_examples, write_problems

    examples = load_examples([write_problems(tmp_path / "p.jsonl", generate_problems(10, seed=0))])[0]

    def fresh():
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), PromptIterator(examples, 3, seed=5)

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)

    def run(model, optimizer, stream, key, steps, ckpt=None, start=0):
        seen = []
        for i in range(start, start + steps):
            batch = next(stream)
            key, sub = jax.random.split(key)
            rows = jnp.asarray([[e.row, len(e.question) % 7, int(e.answer) % 5, i] for e in batch], jnp.float32)
            step(model, optimizer, rows * jax.random.uniform(sub, (1, 4)))
            seen.append([e.row for e in batch])
            if ckpt is not None:
                ckpt.save(i + 1, model=model, optimizer=optimizer, rng=key, data_state=stream.get_state())
        return key, seen

    model, optimizer, stream = fresh()
    with Checkpointer(tmp_path / "ckpt", max_to_keep=1) as ckpt:
        key, first = run(model, optimizer, stream, jax.random.key(0), 4, ckpt)
    _, expected = run(model, optimizer, stream, key, 5, start=4)

    model2, optimizer2, stream2 = fresh()
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(model=model2, optimizer=optimizer2)
    stream2.set_state(restored.data_state)
    assert restored.step == 4
    _, resumed = run(model2, optimizer2, stream2, restored.rng, 5, start=4)
    assert resumed == expected
    for a, b in zip(_leaves(model) + _leaves(optimizer), _leaves(model2) + _leaves(optimizer2)):
        assert np.array_equal(a, b)


def test_modules_holding_typed_rng_keys(tmp_path):
    class WithRngs(nnx.Module):
        def __init__(self, seed):
            self.rngs = nnx.Rngs(seed, dropout=seed + 1)
            self.linear = nnx.Linear(2, 2, rngs=self.rngs)

    model = WithRngs(0)
    model.rngs.dropout()  # advance a stream: count 1
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, model=model)
    other = WithRngs(5)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.restore(model=other)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                nnx.to_pure_dict(nnx.state(model)))
        pure = ckpt.restore(model=abstract).model_state
    assert int(other.rngs.dropout.count[...]) == 1
    for restored in (other.rngs.dropout.key[...], pure["rngs"]["dropout"]["key"]):
        assert jax.dtypes.issubdtype(restored.dtype, jax.dtypes.prng_key)
        assert np.array_equal(jax.random.key_data(restored), jax.random.key_data(model.rngs.dropout.key[...]))
    assert np.array_equal(other.linear.kernel[...], model.linear.kernel[...])


def test_restore_onto_another_mesh(tmp_path):
    """Stage 2 trains on fsdp x tensor 2 from stage 1's FSDP checkpoint: restored bitwise, in the
    new mesh's placements."""
    model, optimizer = _model_and_optimizer(make_mesh(1, 8, 1), seed=0)
    _fake_update(model, optimizer)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    other = make_mesh(1, 4, 2)
    fresh_model, fresh_opt = _model_and_optimizer(other, seed=1)
    shardings = _shardings(fresh_model) + _shardings(fresh_opt)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.restore(model=fresh_model, optimizer=fresh_opt)
    for a, b in zip(_leaves(model) + _leaves(optimizer), _leaves(fresh_model) + _leaves(fresh_opt)):
        assert np.array_equal(a, b)
    assert _shardings(fresh_model) + _shardings(fresh_opt) == shardings
    assert fresh_model.embed[...].sharding.mesh.shape["tensor"] == 2
