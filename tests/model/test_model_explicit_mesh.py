"""Qwen3 forward and backward on meshes of either axis type.

A program that builds its mesh with `jax.make_mesh(..., ("data", "fsdp", "tensor"))` gets Explicit
axes (sharding in types, jax >= 0.10): the model's FSDP-sharded weights, vocab-sharded embedding and
tensor-parallel contractions must all be typed so that JAX accepts them. The project's own meshes
(`rstar_jax.parallel.make_mesh`) are Auto. On both, the logits, hidden states, and the gradient of
the GRPO loss through the chunked head equal a single-device run.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import MESH_AXES, create_sharded_model, make_mesh
from rstar_jax.rl import grpo_loss, token_logprobs

CONFIG = Qwen3Config.tiny()  # shared with test_model_qwen3.py: compilations are reused
TIED = dataclasses.replace(CONFIG, tie_word_embeddings=True, remat_policy="full")
B, T = 8, 16

# name: (config, data, fsdp, tensor, axis type; None for the project's own make_mesh (Auto))
MESHES = {
    "explicit_data2": (CONFIG, 2, 1, 1, AxisType.Explicit),
    "explicit_data2_fsdp2_tensor2": (CONFIG, 2, 2, 2, AxisType.Explicit),
    "explicit_data4_tensor2_tied_remat": (TIED, 4, 1, 2, AxisType.Explicit),
    "auto_data2": (CONFIG, 2, 1, 1, AxisType.Auto),
    "auto_data2_fsdp2_tensor2": (CONFIG, 2, 2, 2, None),
}


def _mesh(data, fsdp, tensor, axis_type):
    n = data * fsdp * tensor
    if axis_type is None:
        return make_mesh(data, fsdp, tensor, devices=jax.devices()[:n])
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(axis_type,) * 3, devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CONFIG.vocab_size, (B, T)).astype(np.int32)
    old = rng.normal(-6.0, 0.3, (B, T - 1)).astype(np.float32)
    mask = (rng.random((B, T - 1)) < 0.8).astype(np.float32)
    advantages = rng.normal(0.0, 1.0, B).astype(np.float32)
    return ids, old, mask, advantages


def _loss(model, ids, old, mask, advantages):
    hidden = model.hidden_states(ids)
    logprobs, entropy = token_logprobs(hidden[:, :-1], model.unembedding(), ids[:, 1:], chunk_size=8,
                                       return_entropy=True)
    loss_sum, count, _ = grpo_loss(logprobs, old, advantages, mask, entropy=entropy, entropy_coef=0.01)
    return loss_sum / count, hidden


@nnx.jit
def _run(model, ids, old, mask, advantages):
    (loss, hidden), grads = nnx.value_and_grad(_loss, has_aux=True)(model, ids, old, mask, advantages)
    return model(ids), hidden, loss, grads


@pytest.fixture(scope="module")
def single_device(batch):
    with jax.default_matmul_precision("highest"):
        return {config: jax.tree.map(np.asarray, _run(Qwen3(config, rngs=nnx.Rngs(0)), *batch))
                for config in (CONFIG, TIED)}


@pytest.mark.parametrize("name", list(MESHES))
def test_forward_and_grads_equal_single_device(name, batch, single_device):
    config, data, fsdp, tensor, axis_type = MESHES[name]
    mesh = _mesh(data, fsdp, tensor, axis_type)
    model = create_sharded_model(config, mesh, seed=0)
    batch_spec = P(("data", "fsdp"))
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        args = [jax.device_put(x, NamedSharding(mesh, batch_spec)) for x in batch[:3]] + [batch[3]]
        logits, hidden, loss, grads = _run(model, *args)
        if axis_type == AxisType.Explicit:
            assert jax.typeof(hidden).sharding.spec[0] in (("data", "fsdp"), "data", "fsdp")
            params = nnx.to_flat_state(nnx.state(model, nnx.Param))
            for (path, g), (_, p) in zip(nnx.to_flat_state(grads), params):
                # Typed as their parameters: the optimizer's update needs no reshard.
                assert jax.typeof(g[...]).sharding.spec == jax.typeof(p[...]).sharding.spec, path
    want_logits, want_hidden, want_loss, want_grads = single_device[config]
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(hidden, want_hidden, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), (_, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        np.testing.assert_allclose(g[...], want[...], atol=1e-6, rtol=1e-4, err_msg=str(path))


def test_explicit_mesh_without_a_mesh_context(batch, single_device):
    """Parameters placed on an Explicit mesh carry it into jit: no `jax.set_mesh` is needed, and
    unsharded (numpy) ids are laid out over the batch axes by the model itself. Here every weight is
    sharded 8 ways on its embed dimension (fsdp=8), and so is the batch."""
    mesh = _mesh(1, 8, 1, AxisType.Explicit)
    model = create_sharded_model(CONFIG, mesh, seed=0)
    with jax.default_matmul_precision("highest"):
        logits, hidden, loss, grads = _run(model, *batch)
    assert jax.typeof(hidden).sharding.spec[0] == "fsdp"
    want_logits, _, want_loss, want_grads = single_device[CONFIG]
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), (_, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        np.testing.assert_allclose(g[...], want[...], atol=1e-6, rtol=1e-4, err_msg=str(path))
