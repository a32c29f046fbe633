"""JaxEngine's decode attention "pallas" (the Pallas GPU paged-attention kernel, in interpret mode on
CPU, over a heads-first pool) against "xla": the same greedy tokens, the same seeded samples,
log-probs within 1e-5 in float32, for rows ending mid-page and exactly on a page boundary, over
three layers, on one device and with the pool split over the tensor axis of 8 fake devices; and
the comparison's teeth: the kernel fed a length off by one, or a wrong softmax scale, is far from
the XLA path.

Why 1e-5: both paths compute the same float32 softmax attention; the kernel scales the query before
the dot and accumulates its flash-decoding blocks in another order, which moves the attention
output by a few ulps (log-probs of order 1-10: about 1e-6). A missed or extra position, or a wrong
scale, moves it by far more (below)."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.model import paged_attention
from rstar_jax.model.paged_attention import kernel_blocks, paged_decode_attention
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config, single_query_attention
from rstar_jax.rollout.protocol import SamplingParams

CONFIG = Qwen3Config.tiny(num_layers=3)  # three layers: a wrong layer offset into the pool shows
SHAPE = dict(slots=4, max_length=64, page_size=8, prefill_buckets=(16, 32))
# With 12 new tokens, rows cross page boundaries while decoding; 16 and 24 start exactly on one
# (the first decode step writes the first position of a fresh page), 5 and 13 mid-page.
PROMPT_LENGTHS = (5, 13, 16, 24)
NEW = 12
PARAMS = [SamplingParams(max_new_tokens=NEW, temperature=0.0),
          SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7),
          SamplingParams(max_new_tokens=NEW, temperature=0.0),
          SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=20, seed=8)]
LOGPROB_ATOL = 1e-5


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def _run(eng, prompts):
    """Every request queued before any is admitted: one prefill group, the same steps on every engine."""
    async def go():
        eng.pause("in_place")
        tasks = [asyncio.ensure_future(eng.generate(p, s)) for p, s in zip(prompts, PARAMS)]
        await asyncio.sleep(0)
        eng.resume()
        return await asyncio.gather(*tasks)

    return asyncio.run(go())


def _assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


def test_pallas_decode_matches_xla_on_one_device(model):
    engines = {a: JaxEngine(model, decode_attention=a, **SHAPE) for a in ("xla", "pallas")}
    try:
        xla, pallas = engines["xla"], engines["pallas"]
        assert pallas.decode_attention == "pallas" and pallas._cache.heads_first and not xla._cache.heads_first
        # The kernel's layout: [kv_heads, layers, pages, page_size, head_dim].
        assert pallas._cache.k.shape == (CONFIG.num_kv_heads, CONFIG.num_layers, xla.num_pages, 8, CONFIG.head_dim)
        prompts = _prompts()
        want = _run(xla, prompts)
        assert all(len(r.token_ids) == NEW for r in want)
        _assert_same(_run(pallas, prompts), want)
        # Pages shared between rows (prefix sharing): two full pages of a common prefix, read by every row.
        shared = [prompts[3][:16] + p[:n] for p, n in zip(_prompts(5), (1, 5, 8, 8))]
        want = _run(xla, shared)
        assert xla.shared_pages > 0 and pallas.shared_pages == 0
        _assert_same(_run(pallas, shared), want)
        assert pallas.shared_pages == xla.shared_pages
    finally:
        for eng in engines.values():
            eng.close()


def test_pallas_decode_matches_xla_with_the_pool_split_over_tensor(model):
    """8 fake devices, FSDP 4 x tensor 2: the heads-first pool is split over its KV heads, and the
    kernel runs under shard_map, each device on its own head and its share of the pool."""
    from rstar_jax.parallel import make_mesh, shard_model

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded = shard_model(model, mesh)
    engines = {a: JaxEngine(sharded, decode_attention=a, mesh=mesh, **SHAPE) for a in ("xla", "pallas")}
    try:
        pool = engines["pallas"]._cache.k.sharding
        assert tuple(pool.spec)[0] == "tensor" and len(pool.device_set) == 8
        assert pool.shard_shape(engines["pallas"]._cache.k.shape)[0] == CONFIG.num_kv_heads // 2
        prompts = _prompts(1)
        _assert_same(_run(engines["pallas"], prompts), _run(engines["xla"], prompts))
    finally:
        for eng in engines.values():
            eng.close()


# -- the kernel against the XLA path, one layer: equal, and unequal when broken -------------------

PAGE, PAGES, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 24, 4, 2, 16, 3
# Rows ending mid-page, one past a page boundary (the newest position alone on its page), exactly
# on one, and a single position; the table 5 pages wide (padded to the kernel's blocks).
LENGTHS = np.array([13, 17, 24, 1], np.int32)


def _pool_and_query(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (KV_HEADS, LAYERS, PAGES, PAGE, HEAD_DIM)  # heads first
    k_pool, v_pool = jax.random.normal(keys[0], shape), jax.random.normal(keys[1], shape)
    q = jax.random.normal(keys[2], (len(LENGTHS), HEADS, HEAD_DIM))
    table = np.random.default_rng(seed).permutation(PAGES)[:len(LENGTHS) * 5].reshape(len(LENGTHS), 5).astype(np.int32)
    table[3, 1:] = PAGES  # unallocated past the row's one page: clipped into the pool, masked
    return q, k_pool, v_pool, table


def _xla(q, k_pool, v_pool, layer, table, lengths):
    """The engine's XLA decode attention over the same pages (gathered, [B, span, Hkv, hd])."""
    b, width = table.shape
    k_seq, v_seq = (jnp.transpose(p[:, layer][:, jnp.minimum(table, PAGES - 1)], (1, 2, 3, 0, 4))
                    .reshape(b, width * PAGE, KV_HEADS, HEAD_DIM) for p in (k_pool, v_pool))
    mask = jnp.arange(width * PAGE)[None, None, :] < lengths[:, None, None]
    return single_query_attention(q[:, None], k_seq, v_seq, mask)[:, 0]


def _distance(got, want):
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))


@pytest.fixture(scope="module")
def kernel_case():
    q, k_pool, v_pool, table = _pool_and_query()
    fused = jax.jit(paged_decode_attention)
    return q, k_pool, v_pool, table, fused, {layer: _xla(q, k_pool, v_pool, layer, table, LENGTHS) for layer in (0, 2)}


def test_the_kernel_equals_the_xla_path_per_layer(kernel_case):
    q, k_pool, v_pool, table, fused, want = kernel_case
    for layer in (0, 2):
        assert _distance(fused(q, k_pool, v_pool, layer, table, LENGTHS), want[layer]) < 1e-5
    assert _distance(want[0], want[2]) > 0.1  # the layers differ: a wrong layer offset would show


def test_the_kernel_over_a_mesh_equals_it_on_one_device(kernel_case):
    """Under shard_map: the pool split over tensor (2 ways, one KV head each), or repeated over a
    mesh without a tensor axis; a row of length 0 (an idle slot) gets zeros either way."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rstar_jax.parallel import make_mesh

    q, k_pool, v_pool, table, _, want = kernel_case
    lengths = LENGTHS.copy()
    lengths[3] = 0
    for fsdp, tensor in ((4, 2), (8, 1)):
        mesh = make_mesh(data=1, fsdp=fsdp, tensor=tensor)
        split = "tensor" if tensor > 1 else None
        pools = [jax.device_put(p, NamedSharding(mesh, P(split))) for p in (k_pool, v_pool)]
        got = np.asarray(jax.jit(lambda *a: paged_decode_attention(*a, mesh=mesh))(q, *pools, 0, table, lengths))
        assert _distance(got[:3], want[0][:3]) < 1e-5 and not np.any(got[3]), (fsdp, tensor)


def test_a_length_off_by_one_differs_from_the_xla_path(kernel_case):
    """One position short: the row whose newest position opens a page (17) loses that page, the
    others their newest position; one too many reads a position that is not the row's."""
    q, k_pool, v_pool, table, fused, want = kernel_case
    for shift in (-1, 1):
        got = np.asarray(fused(q, k_pool, v_pool, 0, table, np.maximum(LENGTHS + shift, 1)))
        for row in range(3):  # every row whose length can move (row 3 stays at 1 when shortened)
            assert _distance(got[row], want[0][row]) > 1e-2, (shift, row)


def test_a_wrong_softmax_scale_differs_from_the_xla_path(kernel_case):
    """The kernel leaves the 1/sqrt(head_dim) to its caller: a query scaled twice, or not at all,
    gives other attention weights."""
    q, k_pool, v_pool, table, fused, want = kernel_case
    for factor in (1 / np.sqrt(HEAD_DIM), np.sqrt(HEAD_DIM)):
        assert _distance(fused(q * factor, k_pool, v_pool, 0, table, LENGTHS), want[0]) > 1e-2, factor


def test_the_kernel_blocks_fit_the_table():
    """k_splits x pages_per_compute_block divides the padded table; compute blocks hold >= 16 positions."""
    for width in (1, 2, 3, 5, 8, 13, 48, 100, 512):
        for page in (1, 4, 8, 16, 64):
            splits, block, padded = kernel_blocks(width, page)
            assert padded >= width and padded % (splits * block) == 0 and padded - width < splits * block
            assert block * page >= 16 and block & (block - 1) == 0 and splits <= paged_attention.MAX_K_SPLITS
    assert kernel_blocks(48, 16) == (4, 8, 64)


def test_shapes_the_kernel_cannot_serve_are_refused_naming_why(model):
    with pytest.raises(ValueError, match=r"JaxEngine: decode_attention must be one of \('xla', 'pallas'\), got 'flash'"):
        JaxEngine(model, decode_attention="flash", **SHAPE)
    with pytest.raises(ValueError, match=r"JaxEngine: decode_attention 'pallas' cannot serve this model and pool: "
                                         r"page_size 12 must be a power of two \(use 'xla'\)"):
        JaxEngine(model, decode_attention="pallas", **{**SHAPE, "page_size": 12})
    problems = paged_attention.unsupported(num_heads=12, num_kv_heads=3, head_dim=24, page_size=16,
                                           dtype=jnp.int8, tensor=2)
    assert [p.split()[0] for p in problems] == ["head_dim", "the", "num_kv_heads"]
    with pytest.raises(ValueError, match=r"decode_attention 'pallas' reads a heads-first KV pool"):
        model.forward_with_paged_cache(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                       model.init_paged_cache(2, 8), jnp.zeros((1, 1), jnp.int32),
                                       decode_attention="pallas")


def test_the_setting_reaches_serve_and_local_servers():
    """`--decode-attention` is checked by `python -m rstar_jax.serve`, and servers started for
    rollout.local_servers get it where it is not the default."""
    import ml_collections

    from rstar_jax.app import builders, serving

    args = serving.parser().parse_args(["--model-path", "tiny", "--decode-attention", "flash"])
    assert "--decode-attention must be one of ('xla', 'pallas'), got 'flash'" in serving.check(args)
    engine = ml_collections.ConfigDict(dict(chunked_prefill_size=0, mem_fraction_static=0.0, layer_layout="stacked",
                                            decode_attention="pallas"))
    assert builders.local_server_flags(engine) == ["--decode-attention", "pallas"]
    engine.decode_attention = "xla"
    assert builders.local_server_flags(engine) == []


@pytest.mark.slow  # a `rstar_jax.serve` subprocess
def test_a_pallas_server_matches_the_full_forward():
    """`python -m rstar_jax.serve --decode-attention pallas`: reported in /get_server_info; greedy
    tokens and log-probs of the full forward (no cache), across page boundaries (pages of 8)."""
    from rstar_jax.engine.local_server import LocalServer
    from rstar_jax.rollout.sglang import SGLangGenerator
    from tests.engine.test_engine import _reference

    config = Qwen3Config.tiny()  # the server's "tiny" preset, seed 0
    prompt = np.random.default_rng(3).integers(1, config.vocab_size, 13).tolist()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def run(url):
        async with SGLangGenerator(url) as gen:
            return await gen.server_info(), await gen.generate(prompt, greedy)

    with LocalServer("tiny", slots=2, max_length=128, page_size=8, seed=0,
                     extra_args=("--decode-attention", "pallas")) as s:
        info, result = asyncio.run(run(s.url))
    assert info["decode_attention"] == "pallas"
    tokens, logprobs = _reference(Qwen3(config, rngs=nnx.Rngs(0)), prompt, 8)
    assert result.token_ids == tokens
    np.testing.assert_allclose(result.logprobs, logprobs, rtol=0, atol=LOGPROB_ATOL)
