"""Qwen3's forwards over per-layer parameters (`layers=`, `unstack_layers`) against the scan over the
stacked ones: the full forward, and the paged-cache prefill and decode, KV pools included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config, unstack_layers

CONFIG = Qwen3Config.tiny(num_layers=3)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


def _layers(model):
    return unstack_layers({name: getattr(model, name)[...] for name in Qwen3.LAYER_PARAMS})


@nnx.jit
def _hidden(model, ids, layers):
    return model.hidden_states(ids, layers=layers)


@nnx.jit
def _paged(model, ids, positions, cache, table, layers):
    return model.forward_with_paged_cache(ids, positions, cache, table, layers=layers)


def test_per_layer_forwards_match_the_scan(model):
    """Each layer's own arrays give the scan's hidden states, logits and KV pools; a prefill then a
    decode step over scattered pages (rows ending mid-page)."""
    layers = _layers(model)
    assert len(layers) == 3 and layers[1]["q_proj"].shape == model.q_proj[...].shape[1:]
    ids = jnp.asarray(np.random.default_rng(0).integers(1, CONFIG.vocab_size, (2, 11)), jnp.int32)
    np.testing.assert_allclose(_hidden(model, ids, layers), _hidden(model, ids, None), rtol=0, atol=1e-5)

    cache = model.init_paged_cache(num_pages=8, page_size=4)
    table = jnp.array([[5, 2, 7, 8], [0, 3, 8, 8]])  # 8: unallocated
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    results = {}
    for name, given in (("per_layer", layers), ("scan", None)):
        logits, pools = _paged(model, ids, positions, cache, table, given)
        step, pools = _paged(model, ids[:, :1], jnp.array([[11], [7]]), pools, table, given)
        results[name] = (logits, step, pools.k, pools.v)
    for got, want in zip(results["per_layer"], results["scan"], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # Layer i's KV lands in pool slice i: the pools differ between layers, so a wrong index shows.
    assert not np.allclose(results["scan"][2][0], results["scan"][2][1])


def test_a_wrong_number_of_layers_is_refused(model):
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="layers holds 2 layers' parameters, the model has 3"):
        model.hidden_states(ids, layers=_layers(model)[:2])
    with pytest.raises(ValueError, match="disagree on the number of layers"):
        unstack_layers({"q_proj": jnp.zeros((3, 2)), "k_proj": jnp.zeros((2, 2))})
