"""JaxEngine: greedy equals full-forward argmax, continuous batching, sampling, weight updates, aborts."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.engine.sampling import sample_tokens
from rstar_jax.rollout.protocol import ContextLengthExceeded, Generator, SamplingParams

CONFIG = Qwen3Config.tiny()


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
    eng = JaxEngine(model, slots=2, max_length=96, prefill_buckets=(16, 32))
    yield eng
    eng.close()


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, n).tolist()


REFERENCE_LENGTH = 128  # causal: right-padding to one shape leaves earlier positions' logits unchanged


@jax.jit
def _full_forward_logits(state, ids):
    with jax.default_matmul_precision("highest"):
        return nnx.merge(GRAPHDEF, state)(ids)[0]


GRAPHDEF = nnx.graphdef(Qwen3(CONFIG, rngs=nnx.Rngs(0)))


def _reference(model, prompt, n):
    """Greedy continuation by repeated full forwards (no KV cache), with raw log-softmax log-probs."""
    seq, logprobs = list(prompt), []
    state = nnx.state(model)
    for _ in range(n):
        ids = np.zeros((1, REFERENCE_LENGTH), np.int32)
        ids[0, :len(seq)] = seq
        logits = _full_forward_logits(state, jnp.asarray(ids))[len(seq) - 1]
        token = int(jnp.argmax(logits))
        logprobs.append(float(jax.nn.log_softmax(logits)[token]))
        seq.append(token)
    return seq[len(prompt):], logprobs


def test_engine_implements_the_generator_protocol(engine):
    assert isinstance(engine, Generator)


def test_greedy_matches_full_forward_argmax_and_logprobs(model, engine):
    prompt = _prompt(11, 0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    result = asyncio.run(engine.generate(prompt, greedy))
    tokens, logprobs = _reference(model, prompt, 8)
    assert result.token_ids == tokens and result.finish_reason == "length"
    np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-5)


def test_continuous_batching_equals_each_alone(model, engine):
    """Five requests on two slots: queueing, interleaving and slot reuse leave outputs unchanged."""
    prompts = [_prompt(n, 10 + n) for n in (5, 17, 9, 30, 3)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in (6, 3, 9, 4, 7)]

    async def together():
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, params)])

    results = asyncio.run(together())
    for p, s, r in zip(prompts, params, results):
        tokens, _ = _reference(model, p, s.max_new_tokens)
        assert r.token_ids == tokens


def test_seeded_sampling_is_independent_of_batching_and_engine_seed(model, engine):
    """A seeded request (SGLang's sampling_seed) draws the same tokens alone, batched with others, on
    another engine with a different engine seed, and when continued as a second turn."""
    prompt = _prompt(12, 21)
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    alone = asyncio.run(engine.generate(prompt, seeded))

    async def crowded():
        others = [engine.generate(_prompt(n, n), SamplingParams(max_new_tokens=9, temperature=1.0)) for n in (7, 20)]
        results = await asyncio.gather(*others, engine.generate(prompt, seeded))
        return results[-1]

    assert asyncio.run(crowded()).token_ids == alone.token_ids
    other_engine = JaxEngine(model, slots=3, max_length=96, prefill_buckets=(16, 32), seed=99)
    try:
        assert asyncio.run(other_engine.generate(prompt, seeded)).token_ids == alone.token_ids
        # Turn two: the first 5 tokens fed back as context continue with the same draws.
        resumed = asyncio.run(other_engine.generate(prompt + alone.token_ids[:5],
                                                    SamplingParams(max_new_tokens=7, temperature=1.0, seed=1234)))
        assert resumed.token_ids == alone.token_ids[5:]
    finally:
        other_engine.close()
    different = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1235)))
    assert different.token_ids != alone.token_ids


def test_stop_tokens_and_context_limit(model, engine):
    prompt = _prompt(8, 3)
    tokens, _ = _reference(model, prompt, 5)
    stop = SamplingParams(max_new_tokens=50, temperature=0.0, stop_token_ids=(tokens[2],))
    r = asyncio.run(engine.generate(prompt, stop))
    assert r.finish_reason == "stop" and r.token_ids == tokens[:tokens.index(tokens[2]) + 1]
    long = asyncio.run(engine.generate(_prompt(90, 4), SamplingParams(max_new_tokens=50, temperature=0.0)))
    assert long.finish_reason == "length" and len(long.token_ids) == 96 - 90
    with pytest.raises(ContextLengthExceeded, match="does not fit"):
        asyncio.run(engine.generate(_prompt(96, 5), SamplingParams(max_new_tokens=2)))
    capacity = asyncio.run(engine.capacity())
    assert (capacity.context_length, capacity.max_input_tokens) == (96, 95)
    assert (capacity.room_for(90), capacity.room_for(95), capacity.room_for(96)) == (6, 1, 0)


def test_overcommitted_pool_retracts_and_recomputes_without_changing_outputs(model, engine):
    """Four requests in a 128-token pool that their outputs outgrow: the engine admits them on
    SGLang's estimate, retracts under pressure and recomputes, and every output (greedy and seeded)
    equals the roomy engine's; no page leaks."""
    small = JaxEngine(model, slots=4, max_length=96, max_total_tokens=128, page_size=8,
                      prefill_buckets=(16, 32, 64))
    prompts = [_prompt(n, 40 + n) for n in (6, 9, 12, 7)]
    params = [SamplingParams(max_new_tokens=70, temperature=0.0), SamplingParams(max_new_tokens=70, temperature=0.0),
              SamplingParams(max_new_tokens=70, temperature=1.0, seed=7),
              SamplingParams(max_new_tokens=66, temperature=0.8, top_k=20, seed=8)]

    async def run(eng):
        return await asyncio.gather(*[eng.generate(p, s) for p, s in zip(prompts, params)])

    try:
        assert asyncio.run(small.capacity()).total_tokens == 128
        crowded, roomy = asyncio.run(run(small)), asyncio.run(run(engine))
        assert small.retractions > 0 and sum(r.num_retractions for r in crowded) == small.retractions
        for c, r, s in zip(crowded, roomy, params):
            assert c.finish_reason == r.finish_reason == "length" and len(c.token_ids) == s.max_new_tokens
            assert c.token_ids == r.token_ids
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=1e-4)
        assert all(r.num_retractions == 0 for r in roomy)
        # Every page is free or held by exactly one cached prefix; flushing the cache frees them all.
        cached = [page for pages in small._prefixes.values() for page in pages]
        assert small.is_idle() and sorted(small._free_pages + cached) == list(range(small.num_pages))
        assert (small._page_table == small.num_pages).all()
        assert small.flush_cache() and sorted(small._free_pages) == list(range(small.num_pages))
    finally:
        small.close()


def test_prefix_cache_continues_a_trajectory_and_yields_its_pages_under_pressure(model):
    """Turn two of a conversation reuses turn one's KV (cached_tokens) and matches a run without the
    cache; a later request that needs the whole 128-token pool evicts the cached pages instead of
    failing or retracting; a weight update drops the cache."""
    eng = JaxEngine(model, slots=2, max_length=128, max_total_tokens=128, page_size=16, prefill_buckets=(16, 32, 128))
    plain = JaxEngine(model, slots=2, max_length=128, page_size=16, prefill_buckets=(16, 32, 128), prefix_cache=False)
    prompt = _prompt(10, 60)
    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0)  # noqa: E731
    try:
        first = asyncio.run(eng.generate(prompt, greedy(12)))
        assert first.cached_tokens == 0 and asyncio.run(eng.capacity()).used_tokens == 0  # cached is evictable
        second_context = prompt + first.token_ids + _prompt(5, 61)  # + a tool observation
        second = asyncio.run(eng.generate(second_context, greedy(10)))
        expected = asyncio.run(plain.generate(second_context, greedy(10)))
        assert second.cached_tokens == 10 + 12 - 1  # the last sampled token's KV was never written
        assert second.token_ids == expected.token_ids and expected.cached_tokens == 0
        np.testing.assert_allclose(second.logprobs, expected.logprobs, atol=1e-4)
        assert eng.cached_tokens == 21 and eng.prompt_tokens == 10 + len(second_context)
        assert eng._prefixes  # turn two's KV is cached in turn
        big = asyncio.run(eng.generate(_prompt(100, 62), greedy(27)))  # 127 tokens: all 8 pages
        assert len(big.token_ids) == 27 and big.num_retractions == 0 and eng.retractions == 0
        assert all(len(key) == 126 for key in eng._prefixes)  # only the big request's prefix is left
        eng.update_weights(model)
        assert not eng._prefixes and sorted(eng._free_pages) == list(range(eng.num_pages))
        assert asyncio.run(eng.generate(second_context, greedy(3))).cached_tokens == 0
    finally:
        eng.close()
        plain.close()


def test_pause_retract_and_in_place_resume_where_they_stopped(model):
    """retract frees the KV and recomputes on resume; in_place keeps it; both finish with the
    output of an uninterrupted run. A weight update while paused swaps without draining."""
    eng = JaxEngine(model, slots=2, max_length=256, prefill_buckets=(16, 256))
    prompt = _prompt(6, 50)
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=3)
    try:
        expected = asyncio.run(eng.generate(prompt, params))

        async def paused_run(mode):
            task = asyncio.ensure_future(eng.generate(prompt, params, rid=f"{mode}"))
            await _wait_for_tokens(eng, mode, 3)
            assert eng.pause(mode) == 1
            try:
                with eng._lock:
                    frozen = [len(r.tokens) for r in list(eng._active) + list(eng._retracted) if r is not None]
                cap = await eng.capacity()
                await asyncio.sleep(0.05)
                with eng._lock:
                    later = [len(r.tokens) for r in list(eng._active) + list(eng._retracted) if r is not None]
                assert frozen == later and len(frozen) == 1 and frozen[0] < 200 and not task.done()
            finally:
                eng.resume()
            return await task, cap

        retracted, cap = asyncio.run(paused_run("retract"))
        assert cap.retracted_requests == 1 and cap.running_requests == 0 and cap.used_tokens == 0
        assert retracted.num_retractions == 1 and retracted.token_ids == expected.token_ids
        held, cap = asyncio.run(paused_run("in_place"))
        assert cap.running_requests == 1 and cap.used_tokens > 0 and cap.retracted_requests == 0
        assert held.num_retractions == 0 and held.token_ids == expected.token_ids
        np.testing.assert_allclose(retracted.logprobs, expected.logprobs, atol=1e-4)

        async def update_while_paused_in_place():
            task = asyncio.ensure_future(eng.generate(prompt, params, rid="swap"))
            await _wait_for_tokens(eng, "swap", 3)
            eng.pause("in_place")
            version = await asyncio.wait_for(asyncio.to_thread(eng.update_weights, model), timeout=60)
            eng.resume()
            return version, await task

        version, result = asyncio.run(update_while_paused_in_place())
        assert version == 1 and result.weight_version == 1 and result.token_ids == expected.token_ids
        with pytest.raises(ValueError, match="mode"):
            eng.pause("freeze")
    finally:
        eng.close()


def test_sampling_distribution_chi_square():
    logits = jnp.log(jnp.asarray([[0.05, 0.1, 0.15, 0.3, 0.4]]))
    n = 4000
    keys = jax.random.split(jax.random.key(0), n)

    def draw(temperature, top_p, top_k):
        f = jax.vmap(lambda k: sample_tokens(logits, k, jnp.asarray([temperature]), jnp.asarray([top_p]),
                                             jnp.asarray([top_k])))
        tokens, logprobs = f(keys)
        tokens, logprobs = np.asarray(tokens)[:, 0], np.asarray(logprobs)[:, 0]
        # SGLang's reported log-prob: log-softmax of logits / T (T = 1 when greedy), before truncation.
        scale = temperature if temperature > 0 else 1.0
        expected_logprobs = np.asarray(jax.nn.log_softmax(logits[0] / scale))[tokens]
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-6)
        return np.bincount(tokens, minlength=5)

    base = np.asarray([0.05, 0.1, 0.15, 0.3, 0.4])
    cases = {
        (1.0, 1.0, -1): base,
        (0.5, 1.0, -1): base ** 2 / np.sum(base ** 2),  # temperature 0.5 squares the probabilities
        (1.0, 1.0, 2): np.asarray([0, 0, 0, 0.3, 0.4]) / 0.7,
        (1.0, 0.65, -1): np.asarray([0, 0, 0, 0.3, 0.4]) / 0.7,  # mass before token 3 is 0.4 < 0.65
    }
    for (t, p, k), expected in cases.items():
        counts = draw(t, p, k)
        support = expected > 0
        assert counts[~support].sum() == 0, (t, p, k)
        _, pvalue = stats.chisquare(counts[support], expected[support] * n)
        assert pvalue > 1e-3, (t, p, k, counts)
    assert draw(0.0, 1.0, -1)[4] == n  # greedy


def test_a_rows_draw_does_not_depend_on_whether_its_batch_sorts():
    """Row 0 (no truncation) draws the same token alone and beside a top-p row that makes the batch
    take the sorting path; the top-p row only ever draws from its nucleus."""
    logits = jax.random.normal(jax.random.key(3), (2, 50)) * 3
    keys = jax.random.split(jax.random.key(4), (300, 2))
    ones = jnp.ones(2)

    @jax.jit
    @jax.vmap
    def mixed_and_alone(row_keys_):
        mixed, _ = sample_tokens(logits, row_keys_, ones, jnp.asarray([1.0, 0.3]), jnp.asarray([-1, -1]))
        alone, _ = sample_tokens(logits[:1], row_keys_[:1], ones[:1], ones[:1], jnp.asarray([-1]))
        return mixed, alone[0]

    mixed, alone = (np.asarray(x) for x in mixed_and_alone(keys))
    np.testing.assert_array_equal(mixed[:, 0], alone)
    assert len(set(alone.tolist())) > 5  # row 0 really samples
    probs = np.asarray(jax.nn.softmax(logits[1]))
    order = np.argsort(-probs)
    nucleus = order[:np.searchsorted(np.cumsum(probs[order]), 0.3) + 1]
    assert set(mixed[:, 1].tolist()) <= set(nucleus.tolist())


def test_truncation_decided_on_the_host_draws_what_the_device_conditional_draws():
    """The engine's decode tells the sampler whether a row truncates (no device conditional, whose
    predicate a GPU reads back to the host): same tokens and log-probs as deciding on the device,
    for a batch that sorts (top-p, top-k) and one that does not."""
    logits = jax.random.normal(jax.random.key(5), (3, 40)) * 3
    keys = jax.random.split(jax.random.key(6), 3)
    temperature = jnp.asarray([1.0, 0.7, 0.0])
    for top_p, top_k, truncation in (([1.0, 0.5, 1.0], [-1, -1, -1], True), ([1.0, 1.0, 1.0], [-1, 5, 1], True),
                                     ([1.0, 1.0, 0.2], [-1, 0, 3], False)):  # row 2 is greedy: it never truncates
        args = (logits, keys, temperature, jnp.asarray(top_p), jnp.asarray(top_k))
        on_device = jax.jit(lambda *a: sample_tokens(*a))(*args)
        on_host = jax.jit(lambda *a, t=truncation: sample_tokens(*a, truncation=t))(*args)
        for device_side, host_side in zip(on_device, on_host):
            np.testing.assert_array_equal(np.asarray(device_side), np.asarray(host_side))


def _wait_for_tokens(eng, rid, n=1):
    """Polls until request `rid` is running and has at least n tokens."""
    async def wait():
        while not any(r is not None and r.rid == rid and len(r.tokens) >= n for r in eng._active):
            await asyncio.sleep(0.0005)
    return wait()


def test_weight_update_changes_outputs_and_bumps_version(model):
    eng = JaxEngine(model, slots=2, max_length=64, prefill_buckets=(16,))
    other = Qwen3(CONFIG, rngs=nnx.Rngs(1))
    prompt = _prompt(7, 6)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    long = SamplingParams(max_new_tokens=57, temperature=0.0)
    try:
        before = asyncio.run(eng.generate(prompt, greedy))
        assert eng.update_weights(other) == 1 and eng.version == 1
        after = asyncio.run(eng.generate(prompt, greedy))
        assert after.weight_version == 1 and before.weight_version == 0
        assert after.token_ids == _reference(other, prompt, 6)[0] != before.token_ids

        async def update_while_running(abort):
            task = asyncio.ensure_future(eng.generate(prompt, long, rid="feed0001"))
            await _wait_for_tokens(eng, "feed0001")
            if not abort:
                await asyncio.to_thread(eng.update_weights, model)
                return await task, None
            for _ in range(5):  # on a loaded machine the request can finish before the lock is taken
                with eng._lock:  # freeze between steps so the partial length is known
                    running = [r for r in eng._active if r is not None]
                    if running:
                        produced = len(running[0].tokens)
                        eng.update_weights(model, abort_in_flight=True)
                if running:
                    return await task, produced
                await task
                task = asyncio.ensure_future(eng.generate(prompt, long, rid="feed0001"))
                await _wait_for_tokens(eng, "feed0001")
            raise AssertionError("the request never stayed running long enough to be aborted")

        # Default: the running request finishes on the old weights (`other`), then the swap happens.
        finished, _ = asyncio.run(update_while_running(abort=False))
        assert finished.finish_reason == "length" and finished.weight_version == 1
        assert finished.token_ids == _reference(other, prompt, 57)[0]
        assert eng.version == 2
        # abort_in_flight: the running request ends at once with its partial tokens.
        eng.update_weights(other)
        aborted, produced = asyncio.run(update_while_running(abort=True))
        assert aborted.finish_reason == "abort" and len(aborted.token_ids) == produced < 57
        assert aborted.token_ids == _reference(other, prompt, produced)[0]
        assert len(aborted.logprobs) == produced and eng.version == 4
        with pytest.raises(ValueError, match="shape"):
            eng.update_weights(Qwen3(Qwen3Config.tiny(hidden_size=32), rngs=nnx.Rngs(0)))
    finally:
        eng.close()


def test_pause_aborts_and_holds_new_requests(engine):
    async def run():
        running = asyncio.ensure_future(engine.generate(_prompt(5, 8), SamplingParams(max_new_tokens=80, temperature=0.0),
                                                        rid="beef0001"))
        await _wait_for_tokens(engine, "beef0001")
        aborted = engine.pause()
        try:  # a failed check must not leave the shared engine paused for the next tests
            held = asyncio.ensure_future(engine.generate(_prompt(5, 9), SamplingParams(max_new_tokens=3,
                                                                                       temperature=0.0)))
            await asyncio.sleep(0.05)
            assert not held.done() and (await engine.capacity()).queued_requests == 1
        finally:
            engine.resume()
        return aborted, await running, await held

    # The running request must still be running when pause() lands; on a loaded machine the engine
    # thread can finish its 80 tokens first (the GIL), so the setup is retried until it was caught.
    for _ in range(5):
        aborted, running, held = asyncio.run(run())
        assert held.finish_reason == "length" and len(held.token_ids) == 3 and engine.is_idle()
        if running.finish_reason == "abort":
            break
    assert aborted >= 1 and running.finish_reason == "abort" and 1 <= len(running.token_ids) < 80


def test_abort_by_rid_prefix(engine):
    """Aborts (prefix match) of a running and of a queued request return their partial tokens."""

    async def run():
        running = asyncio.ensure_future(engine.generate(_prompt(5, 8), SamplingParams(max_new_tokens=80, temperature=0.0),
                                                        rid="abcd0001"))
        while not any(r is not None and r.rid == "abcd0001" for r in engine._active):
            await asyncio.sleep(0.001)
        with engine._lock:  # freeze the engine between two steps
            await engine.abort("abcd")
            queued = asyncio.ensure_future(engine.generate(_prompt(5, 9), SamplingParams(max_new_tokens=5),
                                                           rid="abce0002"))
            await asyncio.sleep(0.01)
            await engine.abort("abce")
        return await running, await queued

    running, queued = asyncio.run(run())
    assert running.finish_reason == "abort" and 1 <= len(running.token_ids) < 80
    assert queued.finish_reason == "abort" and queued.token_ids == []


def test_sharded_engine_on_the_8_device_mesh_matches_and_takes_resharded_weights(model):
    """Parameters FSDP x tensor sharded, KV cache sharded over slots and KV heads; a weight update
    from an unsharded model is resharded onto the engine's placements."""
    from rstar_jax.parallel import make_mesh, shard_model

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded = shard_model(Qwen3(CONFIG, rngs=nnx.Rngs(0)), mesh)
    eng = JaxEngine(sharded, slots=4, max_length=64, prefill_buckets=(16,), mesh=mesh)
    prompts = [_prompt(n, 30 + n) for n in (4, 9, 13)]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)

    async def batch():
        return await asyncio.gather(*[eng.generate(p, greedy) for p in prompts])

    try:
        assert len(eng._cache.k.sharding.device_set) == 8
        for p, r in zip(prompts, asyncio.run(batch())):
            assert r.token_ids == _reference(model, p, 5)[0]
        other = Qwen3(CONFIG, rngs=nnx.Rngs(1))
        eng.update_weights(other)
        leaf = jax.tree.leaves(eng._weights)[0]
        assert len(leaf.sharding.device_set) == 8
        for p, r in zip(prompts, asyncio.run(batch())):
            assert r.token_ids == _reference(other, p, 5)[0]
    finally:
        eng.close()


# Prefix sharing and chunked prefill: one engine shape (8 slots, 8-token pages) with sharing on and off.
SHARING = dict(slots=8, max_length=96, page_size=8, prefill_buckets=(16, 32, 64))


@pytest.fixture(scope="module")
def sharing_pair(model):
    on, off = JaxEngine(model, **SHARING), JaxEngine(model, prefix_sharing=False, **SHARING)
    yield on, off
    on.close()
    off.close()


def _same_outputs(results, expected, atol=1e-5):
    for r, e in zip(results, expected, strict=True):
        assert r.token_ids == e.token_ids and r.finish_reason == e.finish_reason
        np.testing.assert_allclose(r.logprobs, e.logprobs, atol=atol)


def _assert_no_leaks(eng):
    """Idle: no request holds a page; every page is free or held by the cached prefixes naming it."""
    assert eng.is_idle() and not any(eng._slot_refs) and not eng._prefilling.any()
    holders = [0] * eng.num_pages
    for pages in eng._prefixes.values():
        for page in pages:
            holders[page] += 1
    assert holders == eng._cache_refs and sorted(eng._free_pages) == [p for p, n in enumerate(holders) if n == 0]
    assert (eng._page_table == eng.num_pages).all()


def _run_all(eng, prompts, params, rids=None):
    async def run():
        return await asyncio.gather(*[eng.generate(p, s, rid) for p, s, rid in
                                      zip(prompts, params, rids or [None] * len(params))])
    return asyncio.run(run())


def _record_used_pages(eng):
    """Pages in use (neither free nor evictable) at each decode step, from the engine thread."""
    used, grow = [], eng._grow_pages

    def recording():
        grow()
        used.append(eng.num_pages - len(eng._free_pages) - eng._evictable_pages)

    eng._grow_pages = recording
    return used


def test_identical_prompts_share_their_pages_and_sample_as_unshared(sharing_pair):
    """Eight rollouts of one 40-token prompt: one prefill, seven that share its first four pages and
    recompute only the last page; pool use stays under one copy per rollout; seeded samples and
    log-probs equal those of an engine without sharing."""
    on, off = sharing_pair
    prompt = _prompt(40, 80)
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=500 + i) for i in range(8)]
    on_used, off_used = _record_used_pages(on), _record_used_pages(off)
    before = on.shared_pages, on.shared_tokens
    try:
        shared, plain = _run_all(on, [prompt] * 8, params), _run_all(off, [prompt] * 8, params)
    finally:
        del on._grow_pages, off._grow_pages
    _same_outputs(shared, plain)
    assert len({tuple(r.token_ids) for r in shared}) > 1  # the seeds really differ
    assert sorted(r.cached_tokens for r in shared) == [0] + [32] * 7 and all(r.cached_tokens == 0 for r in plain)
    assert (on.shared_pages - before[0], on.shared_tokens - before[1]) == (7 * 4, 7 * 32)
    # 4 shared pages + 2 private per rollout (its last prompt page, one for decoding) against 8 x 6.
    assert max(on_used) <= 4 + 8 * 2 < 8 * 5 <= max(off_used)
    _assert_no_leaks(on)


def test_a_partial_shared_page_is_recomputed_privately(model, sharing_pair):
    """37-token prompts: four full pages shared, the partial fifth recomputed by each sharer; greedy
    tokens and log-probs equal the unshared engine's and the full-forward reference."""
    on, off = sharing_pair
    prompt = _prompt(37, 81)
    params = [SamplingParams(max_new_tokens=6, temperature=0.0)] * 4
    shared, plain = _run_all(on, [prompt] * 4, params), _run_all(off, [prompt] * 4, params)
    _same_outputs(shared, plain)
    assert sorted(r.cached_tokens for r in shared) == [0, 32, 32, 32]
    tokens, logprobs = _reference(model, prompt, 6)
    assert shared[0].token_ids == tokens
    np.testing.assert_allclose(shared[1].logprobs, logprobs, atol=1e-5)
    # Finished requests leave the shared pages cached: a later rollout shares them again.
    again = _run_all(on, [prompt], [SamplingParams(max_new_tokens=6, temperature=0.0)])[0]
    assert again.cached_tokens == 32 and again.token_ids == tokens
    # Two next turns of that conversation: one takes the cached 42-token prefix over (its partial
    # page included), the other shares its five full pages instead of missing.
    turn = [prompt + tokens + [7]] * 2
    params = [SamplingParams(max_new_tokens=4, temperature=0.0)] * 2
    continued = _run_all(on, turn, params)
    assert sorted(r.cached_tokens for r in continued) == [40, 42]
    _same_outputs(continued, _run_all(off, turn, params))
    _assert_no_leaks(on)


def test_shared_prompts_in_an_overcommitted_pool_retract_without_changing_outputs(model):
    """Four rollouts of one prompt in a 16-page pool their outputs outgrow (the shapes of the
    overcommitted-pool test): sharers are retracted and re-admitted (sharing again), outputs equal
    those of the same engine without sharing, and every page comes back."""
    shape = dict(slots=4, max_length=96, max_total_tokens=128, page_size=8, prefill_buckets=(16, 32, 64))
    small, off = JaxEngine(model, **shape), JaxEngine(model, prefix_sharing=False, **shape)
    prompt = _prompt(20, 82)
    params = [SamplingParams(max_new_tokens=70, temperature=0.0), SamplingParams(max_new_tokens=66, temperature=0.0),
              SamplingParams(max_new_tokens=70, temperature=1.0, seed=9),
              SamplingParams(max_new_tokens=68, temperature=0.8, top_k=20, seed=10)]
    try:
        shared, plain = _run_all(small, [prompt] * 4, params), _run_all(off, [prompt] * 4, params)
        assert small.retractions > 0 and small.shared_pages > 0 and off.shared_pages == 0
        _same_outputs(shared, plain, atol=1e-4)
        _assert_no_leaks(small)
        assert small.flush_cache() and sorted(small._free_pages) == list(range(small.num_pages))
        assert not small._page_index and not any(small._cache_refs) and small._evictable_pages == 0
    finally:
        small.close()
        off.close()


def test_aborting_one_sharer_leaves_the_others_untouched(sharing_pair):
    on, off = sharing_pair
    prompt = _prompt(37, 83)
    params = [SamplingParams(max_new_tokens=55 if i == 0 else 20, temperature=1.0, seed=600 + i) for i in range(4)]
    rids = [f"share{i}" for i in range(4)]

    async def run():
        tasks = [asyncio.ensure_future(on.generate(prompt, s, rid)) for s, rid in zip(params, rids)]
        for rid in rids[1:]:
            await _wait_for_tokens(on, rid, 2)
        with on._lock:  # between two steps: the first request (the one that prefilled) is still running
            assert any(r is not None and r.rid == "share0" for r in on._active)
            held = {page for pages in on._slot_pages for page in pages}
            assert (await on.capacity()).used_tokens == len(held) * 8  # a shared page counts once
            assert sum(map(len, on._slot_pages)) - len(held) == 3 * 4  # three sharers of four pages
            await on.abort("share0")
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    expected = _run_all(off, [prompt] * 4, params)
    assert results[0].finish_reason == "abort" and 0 < len(results[0].token_ids) < 55
    assert results[0].token_ids == expected[0].token_ids[:len(results[0].token_ids)]
    _same_outputs(results[1:], expected[1:])
    assert sorted(r.cached_tokens for r in results) == [0, 32, 32, 32]
    _assert_no_leaks(on)


def test_chunked_prefill_matches_unchunked_and_lets_others_decode(model, sharing_pair):
    """A 44-token prompt prefilled 16 tokens per step (within the sharing tests' compiled shapes):
    greedy and seeded outputs equal the unchunked engine's; a running request decodes one token per
    chunk meanwhile; a request retracted mid-prefill (pause "retract") starts over and samples the same."""
    _, off = sharing_pair
    eng = JaxEngine(model, chunked_prefill_size=16, **SHARING)
    long = _prompt(44, 84)
    params = [SamplingParams(max_new_tokens=4, temperature=0.0), SamplingParams(max_new_tokens=4, temperature=1.0,
                                                                               seed=11)]
    calls, prefill, admit = [], eng._prefill_group, eng._admit

    def recording(group):
        running = [len(r.tokens) for r in eng._active if r is not None and r.rid == "short"]
        calls.append(([(r.rid, start, end) for _, r, start, end in group], running))
        prefill(group)

    paused = []

    def pausing():  # pauses (from the engine thread, between two chunks) once "retracted" is mid-prefill
        admit()
        if not paused and any(r is not None and r.rid == "retracted" and eng._prefilling[i]
                              for i, r in enumerate(eng._active)):
            paused.append(eng.pause("retract"))

    eng._prefill_group, eng._admit = recording, pausing
    try:
        chunked, plain = _run_all(eng, [long] * 2, params), _run_all(off, [long] * 2, params)
        _same_outputs(chunked, plain)
        assert chunked[1].cached_tokens == 40  # the second shares the pages the first's chunks wrote

        async def beside_a_decode():
            short = asyncio.ensure_future(eng.generate(_prompt(5, 85), SamplingParams(max_new_tokens=40,
                                                                                      temperature=0.0), "short"))
            await _wait_for_tokens(eng, "short", 2)
            result = await eng.generate(_prompt(44, 86), params[0], "long")
            return result, await short

        calls.clear()
        result, _ = asyncio.run(beside_a_decode())
        chunks = [(rows[0], running) for rows, running in calls if rows[0][0] == "long"]
        assert [row[1:] for row, _ in chunks] == [(0, 16), (16, 32), (32, 44)]
        progress = [running[0] for _, running in chunks]
        assert progress == list(range(progress[0], progress[0] + 3))  # one decoded token per chunk
        assert result.token_ids == _run_all(off, [_prompt(44, 86)], [params[0]])[0].token_ids

        async def retracted_mid_prefill():
            task = asyncio.ensure_future(eng.generate(_prompt(44, 87), params[1], "retracted"))
            while not paused:
                await asyncio.sleep(0.001)
            eng.resume()
            return await task

        result = asyncio.run(retracted_mid_prefill())
        assert paused == [1] and result.num_retractions == 1
        _same_outputs([result], _run_all(off, [_prompt(44, 87)], [params[1]]))
        _assert_no_leaks(eng)
    finally:
        eng.close()


def test_in_place_update_swaps_between_steps_and_tokens_keep_their_versions(model):
    """Asynchronous RL's push: a running request is not drained; it goes on under the new weights,
    and each sampled token reports the version that produced it."""
    eng = JaxEngine(model, slots=2, max_length=64, prefill_buckets=(16,))
    other = Qwen3(CONFIG, rngs=nnx.Rngs(1))
    prompt = _prompt(7, 6)
    long = SamplingParams(max_new_tokens=57, temperature=0.0)
    try:
        assert eng.update_weights(other) == 1
        with pytest.raises(ValueError, match="exclude each other"):
            eng.update_weights(model, abort_in_flight=True, in_place=True)

        async def swap_while_running():
            for _ in range(5):  # on a loaded machine the request can finish before the lock is taken
                task = asyncio.ensure_future(eng.generate(prompt, long, rid="cafe0001"))
                await _wait_for_tokens(eng, "cafe0001")
                with eng._lock:  # between two engine steps
                    running = [r for r in eng._active if r is not None]
                    if running:
                        assert eng.update_weights(model, in_place=True, version=7) == 7
                        # Read after the swap: it first delivers the token of the step in flight,
                        # which the old weights sampled.
                        produced = len(running[0].tokens)
                result = await task
                if running:
                    return result, produced
                eng.update_weights(other, version=1)
            raise AssertionError("the request never stayed running long enough")

        result, produced = asyncio.run(swap_while_running())
        assert result.finish_reason == "length" and len(result.token_ids) == 57 > produced
        assert result.token_versions == (1,) * produced + (7,) * (57 - produced)
        assert result.weight_version == 7
        assert result.token_ids[:produced] == _reference(other, prompt, produced)[0]
    finally:
        eng.close()
