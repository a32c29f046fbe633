"""JaxEngine's per-layer weight layout against the stacked one: the same greedy tokens, the same
seeded samples, log-probs within 1e-5, through prefill and decode, for rows ending mid-page, after
weight swaps (drained and in place), and on a mesh of 8 fake devices with the weights' shardings kept
per layer.

Why 1e-5: both layouts run the same fp32 operations per layer in the same order; only how XLA fuses
the unrolled program against the scanned one differs, which moves float32 results by a few ulps
(log-probs of order 1-10, so about 1e-6 at most); a wrong layer's weights or KV slice moves them by
far more (and changes the greedy tokens)."""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.engine.weights import PerLayerWeights
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rollout.protocol import SamplingParams

CONFIG = Qwen3Config.tiny(num_layers=3)  # three layers: a swapped or repeated layer index shows
SHAPE = dict(slots=4, max_length=64, page_size=8, prefill_buckets=(16, 32))
PROMPT_LENGTHS = (5, 13, 16, 27)  # ending mid-page, mid-page, on a page boundary, mid-page (8-token pages)
PARAMS = [SamplingParams(max_new_tokens=20, temperature=0.0),
          SamplingParams(max_new_tokens=20, temperature=1.0, seed=7),
          SamplingParams(max_new_tokens=20, temperature=0.0),
          SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, seed=8)]
LOGPROB_ATOL = 1e-5


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def other():
    return Qwen3(CONFIG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def engines(model):
    pair = {layout: JaxEngine(model, layer_layout=layout, **SHAPE) for layout in ("stacked", "per_layer")}
    yield pair
    for eng in pair.values():
        eng.close()


def _run(eng, prompts, params=PARAMS, *, swap_to=None, swap_at=0):
    """Every request queued before any is admitted (one prefill group, the same steps on every
    engine). With `swap_to`, the engine pauses in place from its own thread at the first decode step
    where some request holds `swap_at` tokens (a point that depends on nothing but the steps), swaps
    to `swap_to` in place and resumes."""
    paused = []
    if swap_to is not None:
        decode = eng._decode_step

        def decode_or_pause():
            if not paused and any(r is not None and len(r.tokens) >= swap_at for r in eng._active):
                paused.append(eng.pause("in_place"))
                return
            decode()

        eng._decode_step = decode_or_pause

    async def go():
        eng.pause("in_place")
        tasks = [asyncio.ensure_future(eng.generate(p, s)) for p, s in zip(prompts, params)]
        await asyncio.sleep(0)
        eng.resume()
        if swap_to is not None:
            while not paused:
                await asyncio.sleep(0.001)
            await asyncio.to_thread(eng.update_weights, swap_to, in_place=True)
            eng.resume()
        return await asyncio.gather(*tasks)

    try:
        return asyncio.run(go())
    finally:
        if swap_to is not None:
            del eng._decode_step  # the class's method again


def _assert_same(per_layer, stacked):
    for a, b in zip(per_layer, stacked, strict=True):
        assert a.token_ids == b.token_ids
        assert a.token_versions == b.token_versions and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)


def _assert_layers_are(eng, model):
    """The engine's per-layer arrays are `model`'s stacked parameters, sliced."""
    assert isinstance(eng._weights, PerLayerWeights) and len(eng._weights.layers) == CONFIG.num_layers
    for i, layer in enumerate(eng._weights.layers):
        assert set(layer) == set(Qwen3.LAYER_PARAMS)
        for name, w in layer.items():
            np.testing.assert_array_equal(np.asarray(w), np.asarray(getattr(model, name)[...][i]), err_msg=name)


def test_per_layer_prefill_and_decode_match_stacked(model, engines):
    """Greedy and seeded rows (one with top-k) of different lengths, prefilled together and decoded
    across page boundaries; then scoring, and the model the engine reports (restacked)."""
    stacked, per_layer = engines["stacked"], engines["per_layer"]
    _assert_layers_are(per_layer, model)
    assert per_layer.extra_weight_bytes == sum(getattr(model, n)[...].nbytes for n in Qwen3.LAYER_PARAMS)
    assert stacked.extra_weight_bytes == 0
    prompts = _prompts()
    reference = _run(stacked, prompts)
    assert all(len(r.token_ids) == 20 for r in reference)
    _assert_same(_run(per_layer, prompts), reference)
    ids = prompts[3] + reference[3].token_ids[:5]
    for got, want in zip(per_layer.score(ids, top_k=3), stacked.score(ids, top_k=3), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)
    restacked = nnx.state(per_layer.model)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restacked), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


def test_per_layer_weight_swaps_match_stacked(model, other, engines):
    """A drained swap (synchronous RL) and an in-place swap between two decode steps (asynchronous
    RL): the per-layer arrays are cut anew from the pushed stacked parameters each time."""
    stacked, per_layer = engines["stacked"], engines["per_layer"]
    prompts = _prompts(1)
    try:
        for eng in engines.values():
            assert eng.update_weights(other) == 1
        _assert_layers_are(per_layer, other)
        after_swap = _run(stacked, prompts)
        _assert_same(_run(per_layer, prompts), after_swap)
        # In place, back to `model`, once some row holds 6 tokens: earlier tokens are version 1's.
        mixed = _run(stacked, prompts, swap_to=model, swap_at=6)
        versions = {v for r in mixed for v in r.token_versions}
        assert versions == {1, 2} and all(r.token_versions[0] == 1 for r in mixed)
        _assert_same(_run(per_layer, prompts, swap_to=model, swap_at=6), mixed)
        _assert_layers_are(per_layer, model)
        assert [r.token_ids for r in mixed] != [r.token_ids for r in after_swap]  # the swap took effect
    finally:
        for eng in engines.values():
            eng.update_weights(model)


def test_per_layer_on_the_8_device_mesh_keeps_the_shardings_per_layer(model, other):
    """FSDP x tensor sharded parameters: each layer's arrays are placed as the stacked array less its
    layer axis; outputs match the stacked engine's before and after an update from an unsharded model
    (resharded onto the engine's placements, then cut per layer)."""
    from rstar_jax.parallel import make_mesh, shard_model

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded = shard_model(Qwen3(CONFIG, rngs=nnx.Rngs(0)), mesh)
    pair = {layout: JaxEngine(sharded, layer_layout=layout, mesh=mesh, **SHAPE) for layout in ("stacked", "per_layer")}
    stacked, per_layer = pair["stacked"], pair["per_layer"]
    prompts = _prompts(2)

    def assert_placed():
        split_somewhere = False
        for layer in per_layer._weights.layers:
            for name, w in layer.items():
                whole = getattr(sharded, name)[...].sharding
                assert w.sharding.mesh == mesh and len(w.sharding.device_set) == 8, name
                assert tuple(w.sharding.spec) == tuple(whole.spec)[1:], (name, w.sharding.spec, whole.spec)
                split_somewhere |= any(entry is not None for entry in w.sharding.spec)
        assert split_somewhere  # the test means something: some layer weight is split over the mesh

    try:
        assert_placed()
        _assert_same(_run(per_layer, prompts), _run(stacked, prompts))
        for eng in pair.values():
            assert eng.update_weights(other) == 1  # `other` lives on one device
        assert_placed()
        _assert_layers_are(per_layer, other)
        _assert_same(_run(per_layer, prompts), _run(stacked, prompts))
    finally:
        for eng in pair.values():
            eng.close()


def test_an_unknown_layout_is_refused_naming_it(model):
    with pytest.raises(ValueError, match=r"JaxEngine: layer_layout must be one of \('stacked', 'per_layer'\), "
                                         r"got 'unrolled'"):
        JaxEngine(model, layer_layout="unrolled", **SHAPE)
