"""`rstar_jax.rl` on meshes of either axis type, with the batch sharded over data axes.

`jax.make_mesh` makes Explicit axes since jax 0.10 (every array's sharding is part of its type, and
JAX refuses an op whose output sharding it cannot infer); `jax.sharding.Mesh` and
`rstar_jax.parallel.make_mesh` make Auto ones. The chunked log-prob head (forward, entropy, and its
hand-written gradient), the loss, RoC and the advantages must give the unsharded numbers on both,
on 2 and on 8 devices, with the unembedding replicated, vocab-sharded or FSDP-sharded too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rstar_jax.rl import (RocConfig, group_advantages, grpo_loss, naive_token_logprobs, paper_penalty,
                          resample_on_correct, token_logprobs)

B, T, D, V = 8, 21, 32, 256  # T is not a multiple of the chunk: the padded path runs too
CHUNK, TEMPERATURE = 8, 0.7

# name: (mesh shape, mesh axes, hidden's spec, unembedding's spec)
LAYOUTS = {
    "data2": ((2,), ("data",), P("data"), P()),
    "data1_tensor2": ((1, 2), ("data", "tensor"), P("data"), P(None, "tensor")),
    "data8": ((8,), ("data",), P("data"), P()),
    "data4_tensor2": ((4, 2), ("data", "tensor"), P("data"), P(None, "tensor")),
    "data2_fsdp2_tensor2": ((2, 2, 2), ("data", "fsdp", "tensor"), P(("data", "fsdp")), P("fsdp", "tensor")),
}


def _mesh(shape, axes, axis_type):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes), devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    unembedding = (rng.standard_normal((D, V)) / 4).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    weights = rng.standard_normal((B, T)).astype(np.float32)
    return hidden, unembedding, targets, weights


def _objective(fn, weights):
    def objective(h, w, t):
        logprobs, entropy = fn(h, w, t)
        return jnp.sum(logprobs * weights) + 0.3 * jnp.sum(entropy * weights)
    return objective


def _chunked(h, w, t):
    return token_logprobs(h, w, t, chunk_size=CHUNK, temperature=TEMPERATURE, return_entropy=True)


def _naive(h, w, t):
    return naive_token_logprobs(h, w, t, temperature=TEMPERATURE, return_entropy=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_logprobs_and_gradient_on_both_axis_types(inputs, layout):
    hidden, unembedding, targets, weights = inputs
    shape, axes, h_spec, w_spec = LAYOUTS[layout]
    with jax.default_matmul_precision("highest"):
        expected_out = _naive(hidden, unembedding, targets)
        expected_grad = jax.grad(_objective(_naive, weights), argnums=(0, 1))(hidden, unembedding, targets)
        results = {}
        for axis_type in (AxisType.Explicit, AxisType.Auto):
            mesh = _mesh(shape, axes, axis_type)
            with jax.set_mesh(mesh):
                h = jax.device_put(hidden, NamedSharding(mesh, h_spec))
                w = jax.device_put(unembedding, NamedSharding(mesh, w_spec))
                t = jax.device_put(targets, NamedSharding(mesh, h_spec))
                out = jax.jit(_chunked)(h, w, t)
                grad = jax.jit(jax.grad(_objective(_chunked, weights), argnums=(0, 1)))(h, w, t)
                if axis_type == AxisType.Explicit:
                    # Gradients are typed as their primals: an optimizer adds them without a reshard.
                    assert jax.typeof(grad[0]).sharding.spec == jax.typeof(h).sharding.spec
                    assert jax.typeof(grad[1]).sharding.spec == jax.typeof(w).sharding.spec
                    assert jax.typeof(out[0]).sharding.spec[0] == h_spec[0]  # the batch stays sharded
            results[axis_type] = jax.tree.map(np.asarray, (out, grad))
            for got, want in zip(jax.tree.leaves(results[axis_type]), jax.tree.leaves((expected_out, expected_grad))):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{layout} {axis_type}")
    for explicit, auto in zip(jax.tree.leaves(results[AxisType.Explicit]), jax.tree.leaves(results[AxisType.Auto])):
        np.testing.assert_allclose(explicit, auto, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_token_logprobs_without_a_mesh_context(inputs, axis_type):
    """Sharded arguments alone (no `jax.set_mesh`), the hidden states even unsharded: the head takes
    the mesh from the unembedding's type."""
    hidden, unembedding, targets, weights = inputs
    mesh = _mesh((2, 2), ("data", "tensor"), axis_type)
    w = jax.device_put(unembedding, NamedSharding(mesh, P(None, "tensor")))
    with jax.default_matmul_precision("highest"):
        expected = jax.grad(_objective(_naive, weights), argnums=(0, 1))(hidden, unembedding, targets)
        for h, t in [(jax.device_put(hidden, NamedSharding(mesh, P("data"))),
                      jax.device_put(targets, NamedSharding(mesh, P("data")))), (hidden, targets)]:
            grad = jax.jit(jax.grad(_objective(_chunked, weights), argnums=(0, 1)))(h, w, t)
            for got, want in zip(grad, expected):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_devices", [2, 8])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_grpo_loss_value_and_gradient_on_a_data_mesh(n_devices, axis_type):
    """Per-sequence advantages from `group_advantages` (host numpy, replicated) against batch-sharded
    log-probs and mask: the loss, its token count, metrics and gradient are the unsharded ones."""
    rng = np.random.default_rng(1)
    logprobs = rng.normal(-1.0, 0.3, (B, T)).astype(np.float32)
    old = (logprobs + rng.normal(0.0, 0.3, (B, T))).astype(np.float32)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    advantages = group_advantages(rng.integers(0, 2, B).astype(np.float32), np.repeat(np.arange(B // 4), 4))

    def loss(lp, old, mask):
        loss_sum, count, metrics = grpo_loss(lp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
        return loss_sum / count, (loss_sum, count, metrics)

    (value, aux), grad = jax.value_and_grad(loss, has_aux=True)(logprobs, old, mask)
    mesh = _mesh((n_devices,), ("data",), axis_type)
    with jax.set_mesh(mesh):
        batch = NamedSharding(mesh, P("data"))
        args = [jax.device_put(x, batch) for x in (logprobs, old, mask)]
        (value_s, aux_s), grad_s = jax.jit(jax.value_and_grad(loss, has_aux=True))(*args)
        if axis_type == AxisType.Explicit:
            assert jax.typeof(grad_s).sharding.spec == jax.typeof(args[0]).sharding.spec
    np.testing.assert_allclose(value_s, value, rtol=1e-6)
    np.testing.assert_allclose(grad_s, grad, rtol=1e-6, atol=1e-9)
    for got, want in zip(jax.tree.leaves(aux_s), jax.tree.leaves(aux)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_roc_and_advantages_take_sharded_arrays(axis_type):
    """RoC and the advantages run on the host: rewards and counts that a jitted program left sharded
    over `data` are read as their numpy values."""
    rng = np.random.default_rng(2)
    n = 32  # two prompts, 16 rollouts each
    rewards = rng.integers(0, 2, n).astype(np.float32)
    group_ids = np.repeat(np.arange(2), 16).astype(np.int32)
    calls = rng.integers(0, 4, n).astype(np.int32)
    counts = [calls, rng.integers(0, calls + 1).astype(np.int32), rng.integers(0, 3, n).astype(np.int32),
              np.full(n, 2, np.int32)]
    mesh = _mesh((8,), ("data",), axis_type)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    config = RocConfig(group_size=8)
    expected = resample_on_correct(rewards, group_ids, paper_penalty(*counts), config, seed=0)
    got = resample_on_correct(put(rewards), put(group_ids), paper_penalty(*map(put, counts)), config, seed=0)
    np.testing.assert_array_equal(got.kept_indices, expected.kept_indices)
    np.testing.assert_array_equal(group_advantages(put(rewards), put(group_ids)), group_advantages(rewards, group_ids))
