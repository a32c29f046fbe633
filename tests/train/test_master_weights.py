"""bf16 parameters with an fp32 master copy in the optimizer state (`optim.master_weights`): the update
against a NumPy AdamW on the master, small updates that bf16 alone loses, the master's shardings,
checkpoints (exact resume; checkpoints with and without a master restore into runs of the other
kind) and the HF export from the master."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.checkpoint import Checkpointer
from rstar_jax.train.step import (
    MasterWeightsOptimizer,
    OptimizerConfig,
    loss_and_grads,
    make_optimizer,
    place_batch,
    train_step,
    with_master_weights,
)

BF16 = Qwen3Config.tiny(param_dtype="bfloat16", dtype="bfloat16")
FP32 = Qwen3Config.tiny()
LOSS = LossConfig()
MASTER = dict(warmup_steps=0, master_weights="float32")


def _batch(seed=0, n=4, rows=2):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):
        p, r = int(rng.integers(3, 8)), int(rng.integers(4, 12))
        seqs.append(TrainingSequence(prompt_ids=rng.integers(1, BF16.vocab_size, p).tolist(),
                                     response_ids=rng.integers(1, BF16.vocab_size, r).tolist(),
                                     loss_mask=[1] * r, advantage=float(rng.normal()),
                                     old_logprobs=rng.normal(-5.0, 0.3, r).tolist()))
    return make_micro_batches(seqs, rows=rows, row_length=24, packed=False)


def _params(model):
    return {str(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _master(optimizer):
    return {str(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(optimizer.master))}


def _rounded(master: dict) -> dict:
    return {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in master.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_steps_equal_a_numpy_adamw_on_the_fp32_master():
    """Each step: gradients of the bf16 model, cast to fp32, clipped by their global norm, AdamW with
    decoupled decay on the fp32 master (NumPy here); the model's parameters are exactly the master
    rounded to bf16."""
    model = Qwen3(BF16, rngs=nnx.Rngs(0))
    config = OptimizerConfig(lr=1e-3, grad_clip=0.5, weight_decay=0.1, **MASTER)
    optimizer = make_optimizer(model, config)
    assert isinstance(optimizer, MasterWeightsOptimizer)
    master = {k: v.astype(np.float64) for k, v in _master(optimizer).items()}
    assert all(v.dtype == np.float32 for v in _master(optimizer).values())
    assert _same(_params(model), _rounded(_master(optimizer)))
    mu = {k: np.zeros_like(v) for k, v in master.items()}
    nu = {k: np.zeros_like(v) for k, v in master.items()}
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    grads_of = nnx.jit(lambda m, b: loss_and_grads(m, b, LOSS, 8, 1.0, jnp.float32))
    for t in range(1, 4):
        _, grads, _ = grads_of(model, batch)
        grads = {str(path): np.asarray(v[...], np.float64) for path, v in nnx.to_flat_state(grads)}
        assert all(v.dtype == np.float64 for v in grads.values())
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
        metrics = train_step(model, optimizer, batch, LOSS, 8, 1.0)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)  # of the fp32 gradients
        scale = min(1.0, config.grad_clip / norm)
        for k, g in grads.items():
            g = g * scale
            mu[k] = config.b1 * mu[k] + (1 - config.b1) * g
            nu[k] = config.b2 * nu[k] + (1 - config.b2) * g * g
            update = (mu[k] / (1 - config.b1 ** t)) / (np.sqrt(nu[k] / (1 - config.b2 ** t)) + 1e-8)
            master[k] = master[k] - config.lr * (update + config.weight_decay * master[k])
        got = _master(optimizer)
        for k in master:
            np.testing.assert_allclose(got[k], master[k], rtol=1e-6, atol=1e-7, err_msg=f"step {t} {k}")
        assert _same(_params(model), _rounded(got)), f"step {t}: the bf16 parameters are not round(master)"
    moments = [x for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if getattr(x, "ndim", 0) > 0]
    assert moments and all(x.dtype == jnp.float32 for x in moments)  # AdamW's moments are the master's


def test_updates_below_bf16_resolution_move_the_master_and_then_the_parameters():
    """At lr 8e-6 a step moves a weight by at most ~3.2 lr = 2.5e-5, below half the bf16 spacing (3.1e-5)
    of weights in (2^-7, 2^-6): bf16 AdamW alone leaves every such weight where it was, step after
    step; with the fp32 master the steps add up until they move the bf16 weights."""
    batch = {k: jnp.asarray(v) for k, v in _batch(seed=1).items()}
    initial = _params(Qwen3(BF16, rngs=nnx.Rngs(0)))
    in_range = {k: (np.abs(v.astype(np.float32)) > 2 ** -7) & (np.abs(v.astype(np.float32)) < 2 ** -6)
                for k, v in initial.items()}
    assert sum(int(m.sum()) for m in in_range.values()) > 1000
    moved = {}
    for master in ("", "float32"):
        model = Qwen3(BF16, rngs=nnx.Rngs(0))
        optimizer = make_optimizer(model, OptimizerConfig(lr=8e-6, warmup_steps=0, master_weights=master))
        for _ in range(8):
            train_step(model, optimizer, batch, LOSS, 8, 1.0)
        after = _params(model)
        moved[master] = sum(int((after[k] != initial[k])[in_range[k]].sum()) for k in initial)
        if master:
            drift = max(float(np.abs(v - initial[k].astype(np.float32)).max()) for k, v in _master(optimizer).items())
            assert drift > 2e-5  # the master moved by several steps' worth
            assert _same(after, _rounded(_master(optimizer)))
    assert moved[""] == 0, "bf16 AdamW moved weights it cannot move by less than half their spacing"
    assert moved["float32"] > 100, moved


def test_master_is_sharded_as_the_parameters_and_stays_so():
    """On the 8 fake devices, also on an Explicit mesh: master and moments have each parameter's
    NamedSharding before and after a donated step."""
    batch = _batch(seed=2, n=8, rows=8)  # rows split over the data-parallel axes (4 devices)
    meshes = [make_mesh(1, 4, 2),
              jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)]
    for mesh in meshes:
        model = create_sharded_model(BF16, mesh, seed=0)
        optimizer = make_optimizer(model, OptimizerConfig(lr=1e-3, **MASTER))

        def check():
            params = {str(p): v[...].sharding for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
            master = {str(p): v[...].sharding for p, v in nnx.to_flat_state(nnx.state(optimizer.master))}
            assert master == params
            assert any(len(s.device_set) == 8 and not s.is_fully_replicated for s in master.values())
            mu = optimizer.opt_state[1][0].mu  # clip_by_global_norm, then adamw's ScaleByAdamState
            assert {str(p): v[...].sharding for p, v in nnx.to_flat_state(nnx.state(mu))} == params

        check()
        train_step(model, optimizer, place_batch(batch, mesh), LOSS, 8, 1.0)
        check()
        assert _same(_params(model), _rounded(_master(optimizer)))


def _fake_update(model, optimizer):
    grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32)) + 0.5, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)


_fake_update_jit = nnx.jit(_fake_update)


def _sharded(config, seed, master, mesh):
    model = create_sharded_model(config, mesh, seed=seed)
    return model, make_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=0, master_weights=master))


def _leaves(obj):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(obj))]


def test_checkpoint_round_trip_is_exact_and_resume_continues_identically(tmp_path):
    mesh = make_mesh(1, 4, 2)
    model, optimizer = _sharded(BF16, 0, "float32", mesh)
    for _ in range(2):
        _fake_update_jit(model, optimizer)
    exported = []
    with Checkpointer(tmp_path / "ckpt", async_save=False, export_every=2,
                      export_hf=lambda step, path, opt: exported.append((step, opt))) as ckpt:
        ckpt.save(2, model=model, optimizer=optimizer)
    assert exported == [(2, optimizer)]  # the export hook gets the optimizer: its master is what to write
    fresh_model, fresh_opt = _sharded(BF16, 1, "float32", mesh)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.restore(model=fresh_model, optimizer=fresh_opt).optimizer_restored
    for a, b in zip(_leaves(model) + _leaves(optimizer), _leaves(fresh_model) + _leaves(fresh_opt)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert _master(fresh_opt).keys() == _params(fresh_model).keys()
    for m, o in ((model, optimizer), (fresh_model, fresh_opt)):
        _fake_update_jit(m, o)
    for a, b in zip(_leaves(model) + _leaves(optimizer), _leaves(fresh_model) + _leaves(fresh_opt)):
        assert np.array_equal(a, b)


def test_checkpoints_with_and_without_a_master_restore_into_runs_of_the_other_kind(tmp_path):
    """fp32 parameters -> bf16 with a master: the master is the checkpoint's fp32 parameters (nothing
    lost), AdamW's moments carry over. A master -> fp32 parameters without one: the parameters are the
    master. reset_optimizer keeps the precision too: fresh moments, the saved master (or the fp32
    parameters)."""
    mesh = make_mesh(1, 4, 2)
    fp32_model, fp32_opt = _sharded(FP32, 0, "", mesh)
    _fake_update_jit(fp32_model, fp32_opt)
    bf16_model, bf16_opt = _sharded(BF16, 0, "float32", mesh)
    _fake_update_jit(bf16_model, bf16_opt)
    with Checkpointer(tmp_path / "plain", async_save=False) as ckpt:
        ckpt.save(1, model=fp32_model, optimizer=fp32_opt)
    with Checkpointer(tmp_path / "master", async_save=False) as ckpt:
        ckpt.save(1, model=bf16_model, optimizer=bf16_opt)

    # Without a master -> with one.
    model, optimizer = _sharded(BF16, 3, "float32", mesh)
    with Checkpointer(tmp_path / "plain") as ckpt:
        assert ckpt.restore(model=model, optimizer=optimizer).optimizer_restored
    assert _same(_master(optimizer), _params(fp32_model))
    assert _same(_params(model), _rounded(_params(fp32_model)))
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(optimizer.opt_state), _leaves(fp32_opt.opt_state)))
    assert int(optimizer.step[...]) == 1

    # With a master -> fp32 parameters without one: they are the master, moments and count carry over.
    model, optimizer = _sharded(FP32, 3, "", mesh)
    with Checkpointer(tmp_path / "master") as ckpt:
        restored = ckpt.restore(model=model, optimizer=optimizer)
    assert restored.optimizer_restored and "master" not in restored.optimizer_state
    assert _same(_params(model), _master(bf16_opt))
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(optimizer.opt_state), _leaves(bf16_opt.opt_state)))

    # reset_optimizer (stage 3): fresh moments and count, the master from the checkpoint.
    for source, expected in (("master", _master(bf16_opt)), ("plain", _params(fp32_model))):
        model, optimizer = _sharded(BF16, 3, "float32", mesh)
        with Checkpointer(tmp_path / source) as ckpt:
            restored = ckpt.restore(model=model, optimizer=optimizer, reset_optimizer=True)
        assert not restored.optimizer_restored and restored.optimizer_state is None
        assert _same(_master(optimizer), expected), source
        assert _same(_params(model), _rounded(expected)), source
        assert int(optimizer.step[...]) == 0
        assert all(not np.any(x) for x in _leaves(optimizer.opt_state) if x.ndim > 0)
        shardings = {str(p): v[...].sharding for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        assert {str(p): v[...].sharding for p, v in nnx.to_flat_state(nnx.state(optimizer.master))} == shardings


def test_export_writes_the_master_and_the_weight_sync_the_bf16_parameters(tmp_path):
    """An fp32 HF export of a run with a master carries the master's values, not the bf16 ones; the
    live model (what weight sync and the engine read) keeps its bf16 parameters."""
    from safetensors.numpy import load_file

    from rstar_jax.model.hf import save_pretrained

    model = Qwen3(BF16, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-4, **MASTER))
    for _ in range(3):
        _fake_update_jit(model, optimizer)
    master = _master(optimizer)
    assert not _same(_rounded(master), {k: v.astype(np.float32) for k, v in master.items()})  # below bf16
    view = with_master_weights(model, optimizer)
    assert with_master_weights(model, None) is model
    out = save_pretrained(view, tmp_path / "fp32", dtype="float32")
    tensors = load_file(out / "model.safetensors")
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], master[str(("embed",))])
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert model.embed[...].dtype == jnp.bfloat16 and _same(_params(model), _rounded(master))
    bf16 = load_file(save_pretrained(view, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors")
    assert np.array_equal(bf16["model.embed_tokens.weight"].view(np.uint16),
                          np.asarray(model.embed[...]).view(np.uint16))  # the same bytes either way


def test_a_master_of_fp32_parameters_is_refused():
    with pytest.raises(ValueError, match=r"master_weights='float32'.*is float32"):
        make_optimizer(Qwen3(FP32, rngs=nnx.Rngs(0)), OptimizerConfig(**MASTER))
    with pytest.raises(ValueError, match="OptimizerConfig.master_weights must be one of"):
        OptimizerConfig(master_weights="bfloat16")


def test_config_names_the_field_and_reaches_both_optimizers():
    """optim.master_weights: one of ('', 'float32'), only with lower-precision parameters; RL's and
    SFT's optimizers both take it."""
    from rstar_jax.config import DEFAULT_CONFIG, load_config_file, resolve, validate
    from rstar_jax.errors import ConfigError

    config = load_config_file(DEFAULT_CONFIG)
    assert config.optim.master_weights == "" and config.model.param_dtype == "float32"
    config.optim.master_weights = "float32"
    with pytest.raises(ConfigError, match=r"^config.optim.master_weights: 'float32' keeps an fp32 master copy .* "
                                          r"got model.param_dtype='float32'"):
        validate(config)
    config.optim.master_weights = "bfloat16"
    with pytest.raises(ConfigError, match=r"^config.optim.master_weights: must be one of \('', 'float32'\)"):
        validate(config)
    config.optim.master_weights = "float32"
    config.model.param_dtype = "bfloat16"
    validate(config)
    assert resolve.optimizer_config(config).master_weights == "float32"
    assert resolve.sft_optimizer_config(config, 100).master_weights == "float32"


@pytest.mark.slow  # the launcher in a subprocess
def test_an_sft_run_with_a_master_exports_it_and_its_checkpoint_holds_it(tmp_path):
    """`python -m rstar_jax.launch` in SFT mode with bf16 parameters and optim.master_weights=float32:
    the final HF export, at checkpoint.export_dtype "" (the precision the run trains in), is fp32 and
    the master of the final checkpoint, value for value (values bf16 cannot hold), and the
    checkpoint's parameters are that master rounded to bf16."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from tests.conftest import TINY_TEST_SFT, xla_flags

    run = tmp_path / "run"
    command = [sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={run}", "--config.mode=sft",
               "--config.metrics.progress_bar=false", *TINY_TEST_SFT, "--config.sft.epochs=1",
               "--config.data.synthetic.sft_stages=((16,(0,1,0)),)", "--config.checkpoint.every_steps=4",
               "--config.checkpoint.export_hf_every=0", "--config.checkpoint.export_dtype=",
               "--config.model.param_dtype=bfloat16", "--config.optim.master_weights=float32"]
    result = subprocess.run(command, cwd=tmp_path, env={**os.environ, "XLA_FLAGS": xla_flags()},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    exported = load_file(str(run / "hf" / "final" / "model.safetensors"))
    embed = exported["model.embed_tokens.weight"]
    assert embed.dtype == np.float32
    assert np.mean(np.asarray(jnp.asarray(embed).astype(jnp.bfloat16).astype(jnp.float32)) != embed) > 0.5

    from rstar_jax.config import DEFAULT_CONFIG, load_config_file, resolve

    config = load_config_file(DEFAULT_CONFIG)
    config.model.param_dtype = "bfloat16"
    model = Qwen3(resolve.model_config(config), rngs=nnx.Rngs(1))
    optimizer = make_optimizer(model, OptimizerConfig(**MASTER))
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.restore(model=model, optimizer=optimizer)
    np.testing.assert_array_equal(_master(optimizer)[str(("embed",))], embed)
    assert _same(_params(model), _rounded(_master(optimizer)))
