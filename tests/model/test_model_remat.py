"""Remat policies that keep the decoder layer's named activations (`checkpoint_name`): the same loss
and gradients as no remat, and the residuals saved across the layer scan are the named ones (on the
device or, for the offloading policies, in pinned host memory)."""

import collections
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model import qwen3
from rstar_jax.model.qwen3 import REMAT_NAMES, REMAT_POLICY_NAMES, Qwen3, Qwen3Config

NAMED_POLICIES = [p for p in REMAT_POLICY_NAMES if p.startswith(("save_", "offload_"))]
IDS = jnp.asarray(np.random.default_rng(7).integers(1, 320, size=(2, 8)), jnp.int32)


def _loss_fn(policy: str):
    graphdef, state = nnx.split(Qwen3(Qwen3Config.tiny(remat_policy=policy), rngs=nnx.Rngs(0)))

    def loss(state):
        logits = nnx.merge(graphdef, state)(IDS)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(IDS.shape[1]))

    return loss, state


def test_named_policies_are_listed():
    assert NAMED_POLICIES == ["save_attention", "save_qkv_attention", "save_named", "offload_mlp", "offload_named"]
    assert set(NAMED_POLICIES) <= set(qwen3.REMAT_POLICIES)


@pytest.mark.parametrize("policy", NAMED_POLICIES)
def test_named_policy_gives_the_loss_and_gradients_of_no_remat(policy):
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_loss_fn("none")[0]))(_loss_fn("none")[1])
    loss_fn, state = _loss_fn(policy)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(ref_grads), nnx.to_flat_state(grads)):
        np.testing.assert_allclose(b[...], a[...], atol=1e-6, rtol=1e-6, err_msg=f"{policy}: {path}")


def _scan_residuals(policy: str, capsys) -> collections.Counter:
    """The residuals the layer scan hands to the backward, as a multiset of 'type[shape]' strings
    (`<host>` marks pinned host memory), read from `jax.ad_checkpoint.print_saved_residuals`."""
    loss_fn, state = _loss_fn(policy)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss_fn, state)
    lines = capsys.readouterr().out.splitlines()
    return collections.Counter(re.match(r"(\S+)", line).group(1) for line in lines if "output of scan" in line)


def test_named_residuals_are_the_saved_ones(capsys):
    """Tiny config, layers L=2, B=2, T=8: the last layer's output f32[2,8,64] (for the final norm) and
    the stacked layer inputs f32[2,2,8,64] are always saved; the
    named activations have their own shapes: q and attention's output [.., 4 heads, 16], k and v
    [.., 2 kv heads, 16], o_proj's output [.., 64], the MLP's gate and up [.., 128]. Without the names
    the save_* policies would save nothing but the layer inputs."""
    h, heads, kv, ffn = "f32[2,2,8,64]", "f32[2,2,8,4,16]", "f32[2,2,8,2,16]", "f32[2,2,8,128]"
    host = lambda s: s.replace("f32[", "f32<host>[")  # noqa: E731
    expected = {
        "full": {h: 1},
        "save_attention": {h: 1, heads: 1},
        "save_qkv_attention": {h: 1, heads: 2, kv: 2},
        "save_named": {h: 2, heads: 2, kv: 2, ffn: 2},
        "offload_mlp": {h: 1, heads: 2, kv: 2, host(h): 1, host(ffn): 2},
        "offload_named": {h: 1, host(heads): 2, host(kv): 2, host(h): 1, host(ffn): 2},
    }
    for policy, want in expected.items():
        assert _scan_residuals(policy, capsys) == collections.Counter({"f32[2,8,64]": 1, **want}), policy


def test_every_name_is_applied_in_the_layer():
    loss_fn, state = _loss_fn("save_named")
    text = str(jax.make_jaxpr(loss_fn)(state))
    for name in REMAT_NAMES:
        assert f"name={name}" in text, name


def test_offload_is_refused_without_pinned_host_memory(monkeypatch):
    device = types.SimpleNamespace(platform="fake", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    monkeypatch.setattr(qwen3.jax, "devices", lambda *a: [device])
    model = nnx.eval_shape(lambda: Qwen3(Qwen3Config.tiny(remat_policy="offload_mlp"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="Qwen3Config.remat_policy='offload_mlp'.*pinned host"):
        model.hidden_states(IDS)
    qwen3.check_remat_backend("save_named")  # no offload: nothing to check


def test_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="Qwen3Config.remat_policy"):
        Qwen3Config.tiny(remat_policy="save_everything")
