"""attention_impl="blockwise": xla_attention's values and gradients over query blocks, holding no
[T, S] score matrix for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config, blockwise_attention, sequence_positions, xla_attention


def _inputs(t=37, seed=0):
    rng = np.random.default_rng(seed)
    b, h, kv, hd = 2, 4, 2, 16
    q, k, v, w = (jnp.asarray(rng.normal(size=s), jnp.float32)
                  for s in ((b, t, h, hd), (b, t, kv, hd), (b, t, kv, hd), (b, t, h, hd)))
    seg = jnp.asarray([[1] * 10 + [2] * 20 + [0] * (t - 30), [1] * t])  # packed with padding; one sequence
    return q, k, v, w, seg, sequence_positions(seg)


@pytest.mark.parametrize("block", [8, 64])  # 37 rows: padded to whole blocks; one block bigger than the row
def test_blockwise_equals_xla_attention_and_its_gradients(block):
    q, k, v, w, seg, pos = _inputs()
    mask = (pos[:, :, None] >= pos[:, None, :]) & (seg[:, :, None] == seg[:, None, :])
    with jax.default_matmul_precision("highest"):
        want = xla_attention(q, k, v, mask)
        got = blockwise_attention(q, k, v, pos, seg, block=block)
        np.testing.assert_allclose(got, want, atol=2e-6)
        grads_want = jax.grad(lambda *a: jnp.sum(w * xla_attention(*a, mask)), (0, 1, 2))(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(w * blockwise_attention(*a, pos, seg, block=block)),
                                 (0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", grads_want, grads):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


def test_blockwise_model_matches_xla_model():
    ids = jnp.asarray(np.random.default_rng(3).integers(1, 320, size=(2, 24)), jnp.int32)
    seg = jnp.asarray([[1] * 9 + [2] * 15, [1] * 20 + [0] * 4])

    def loss_and_grads(impl):
        model = Qwen3(Qwen3Config.tiny(attention_impl=impl, remat_policy="full"), rngs=nnx.Rngs(0))

        def loss(m):
            return jnp.mean(jax.nn.log_softmax(m(ids, sequence_positions(seg), seg))[..., 1])

        return nnx.jit(nnx.value_and_grad(loss))(model)

    with jax.default_matmul_precision("highest"):
        (loss_x, grads_x), (loss_b, grads_b) = loss_and_grads("xla"), loss_and_grads("blockwise")
    np.testing.assert_allclose(loss_b, loss_x, rtol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads_x), nnx.to_flat_state(grads_b)):
        np.testing.assert_allclose(b[...], a[...], atol=1e-6, err_msg=str(path))


def test_blockwise_saves_no_score_matrix(capsys):
    """Without remat the backward gets q, k, v, the output and per-row statistics from each layer:
    nothing of T x S (24 x 24) size, where xla_attention saves its probabilities."""
    ids = jnp.ones((2, 24), jnp.int32)

    def residuals(impl):
        graphdef, state = nnx.split(Qwen3(Qwen3Config.tiny(attention_impl=impl), rngs=nnx.Rngs(0)))
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(ids)), state)
        return capsys.readouterr().out

    assert "24,24]" in residuals("xla")
    assert "24,24]" not in residuals("blockwise")
