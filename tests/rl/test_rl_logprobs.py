"""Chunked token log-probs: equal to the full-logits path (values and gradients), and memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl.logprobs import naive_token_logprobs, token_logprobs

B, T, D, V = 2, 37, 16, 96


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    return hidden, w, targets, weights


@pytest.mark.parametrize("chunk", [1, 8, 10, 37, 64])
def test_chunked_equals_naive_with_gradients(inputs, chunk):
    hidden, w, targets, weights = inputs
    with jax.default_matmul_precision("highest"):
        def objective(fn, h, u):
            lp, ent = fn(h, u)
            return jnp.sum(lp * weights) + 0.3 * jnp.sum(ent * weights)

        chunked = lambda h, u: token_logprobs(h, u, targets, chunk_size=chunk, temperature=0.7,  # noqa: E731
                                              return_entropy=True)
        naive = lambda h, u: naive_token_logprobs(h, u, targets, temperature=0.7, return_entropy=True)  # noqa: E731
        lp_c, ent_c = chunked(hidden, w)
        lp_n, ent_n = naive(hidden, w)
        np.testing.assert_allclose(lp_c, lp_n, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ent_c, ent_n, atol=1e-5, rtol=1e-5)
        g_c = jax.grad(lambda h, u: objective(chunked, h, u), argnums=(0, 1))(hidden, w)
        g_n = jax.grad(lambda h, u: objective(naive, h, u), argnums=(0, 1))(hidden, w)
        for a, b in zip(g_c, g_n):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_temperature_is_traced_not_static(inputs):
    hidden, w, targets, _ = inputs
    traces = []  # one per trace: a static temperature would trace again for a new value

    def logprobs_at(t):
        traces.append(t)
        return token_logprobs(hidden, w, targets, chunk_size=8, temperature=t)

    f = jax.jit(logprobs_at)
    f(1.0)
    f(0.6)
    assert len(traces) == 1


def test_shape_errors_name_the_argument(inputs):
    hidden, w, targets, _ = inputs
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(hidden, w, targets[:, :5])


@pytest.mark.parametrize("d, dtype, share", [(128, jnp.float32, 1 / 10), (2048, jnp.bfloat16, 0.3)])
def test_memory_is_a_fraction_of_naive_at_qwen3_vocab_and_8k(d, dtype, share):
    """Compiled temporary memory of log-probs + loss gradient at V=151,936, T=8,192 (no execution).

    At Qwen3-1.7B's width (bf16 hidden, fp32 unembedding) the CPU backend also holds a bf16 copy of
    the unembedding, its transpose and one chunk's [D, V] gradient product before it is accumulated:
    under 30% here (autodiff of the checkpointed scan needed 36%).
    """
    b, t, v = 1, 8192, 151_936
    hidden = jax.ShapeDtypeStruct((b, t, d), dtype)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(fn):
        return jax.grad(lambda h, u, tg: jnp.sum(fn(h, u, tg)), argnums=(0, 1))

    chunked = jax.jit(loss(lambda h, u, tg: token_logprobs(h, u, tg, chunk_size=512)))
    naive = jax.jit(loss(lambda h, u, tg: naive_token_logprobs(h, u, tg)))
    mem_c = chunked.lower(hidden, w, targets).compile().memory_analysis().temp_size_in_bytes
    mem_n = naive.lower(hidden, w, targets).compile().memory_analysis().temp_size_in_bytes
    full_logits = b * t * v * 4
    assert mem_n >= full_logits  # the naive path really holds [B, T, V] logits
    assert mem_c <= mem_n * share, (mem_c, mem_n)


def test_gradients_on_an_explicit_mesh():
    """`jax.make_mesh`'s default axes are Explicit (sharding in types): the hand-written backward pass
    must say how its batch-contracting einsums shard their outputs, or JAX refuses to trace it. Here
    as a data-parallel program has it: the batch sharded, the unembedding replicated."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((4, 16, 8)).astype(np.float32)
    unembedding = rng.standard_normal((8, 32)).astype(np.float32)
    targets = rng.integers(0, 32, (4, 16)).astype(np.int32)

    def loss(h, w, t):
        logprobs, entropy = token_logprobs(h, w, t, chunk_size=4, return_entropy=True)
        return (logprobs * jnp.linspace(0.5, 1.5, 16)).sum() + 0.1 * entropy.sum()

    def naive_loss(h, w, t):
        logprobs, entropy = naive_token_logprobs(h, w, t, return_entropy=True)
        return (logprobs * jnp.linspace(0.5, 1.5, 16)).sum() + 0.1 * entropy.sum()

    expected = jax.grad(naive_loss, argnums=(0, 1))(hidden, unembedding, targets)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        h = jax.device_put(hidden, NamedSharding(mesh, P("data")))
        w = jax.device_put(unembedding, NamedSharding(mesh, P()))
        t = jax.device_put(targets, NamedSharding(mesh, P("data")))
        g_h, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w, t)
        assert jax.typeof(g_h).sharding.spec == jax.typeof(h).sharding.spec
        assert jax.typeof(g_w).sharding.spec == jax.typeof(w).sharding.spec
    np.testing.assert_allclose(np.asarray(g_h), expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_w), expected[1], rtol=1e-5, atol=1e-5)
