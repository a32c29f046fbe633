"""The SGLang client against a real SGLang 0.5.23 server (CPU engine) on a tiny Qwen3 the project
exported: token-in/token-out generation equal to the JAX reference, capacity and the request limits
at SGLang's exact boundaries, the vocabulary check, the prefix cache across turns, the three pause
modes (an aborted turn continued from its partial output equals the uninterrupted one), and both
weight syncs."""

import asyncio
import json
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.hf import load_pretrained, save_pretrained
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rollout.protocol import ContextLengthExceeded, SamplingParams
from rstar_jax.rollout.scheduler import KvScheduler
from rstar_jax.rollout.sglang import SGLangGenerator

CONTEXT, POOL = 512, 4096
# SGLang's own bounds for these flags: inputs shorter than max_req_input_len = min(context, pool) - 6,
# input + max_new_tokens at most the context length (and at most context - 2 tokens in all are made).
MAX_INPUT = min(CONTEXT, POOL) - 6 - 1


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def reference(model, prompt, n):
    """Greedy continuation by full forwards (no cache) with raw log-softmax log-probs."""
    seq, logprobs = list(prompt), []
    with jax.default_matmul_precision("highest"):
        for _ in range(n):
            logits = model(jnp.asarray([seq]))[0, -1]
            token = int(jnp.argmax(logits))
            logprobs.append(float(jax.nn.log_softmax(logits)[token]))
            seq.append(token)
    return seq[len(prompt):], logprobs


def prompt(n, seed, vocab=320):
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def server(start_sglang_session, tiny_qwen3_checkpoint):
    return start_sglang_session(tiny_qwen3_checkpoint, context_length=CONTEXT, max_total_tokens=POOL)


def test_greedy_tokens_and_logprobs_equal_the_jax_reference(server, tiny_qwen3_checkpoint):
    model = load_pretrained(tiny_qwen3_checkpoint)
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 17, 60))]

    async def run():
        async with SGLangGenerator(server.url) as gen:
            return await asyncio.gather(*(gen.generate(p, greedy(16)) for p in prompts))

    for p, result in zip(prompts, asyncio.run(run())):
        tokens, logprobs = reference(model, p, 16)
        assert result.token_ids == tokens and result.finish_reason == "length"
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)


def test_capacity_limits_and_the_kv_scheduler_ledger(server):
    async def run():
        async with SGLangGenerator(server.url) as gen:
            capacity = await gen.capacity()
            scheduler = KvScheduler([gen])
            await scheduler.reconcile()
            return capacity, scheduler.ledgers[0]

    capacity, ledger = asyncio.run(run())
    assert (capacity.total_tokens, capacity.ranks) == (POOL, 1)
    assert (capacity.context_length, capacity.max_input_tokens) == (CONTEXT, MAX_INPUT)
    assert ledger.capacity == POOL and ledger.limits.context_length == CONTEXT


def test_requests_fit_sglangs_own_limits_exactly(server):
    """Each limit the client applies is where SGLang's own checks are: sent as is, the same requests
    are HTTP 400 (the defect: empty, zero-reward trajectories); fitted, they generate."""
    long_budget = {"max_new_tokens": 100, "temperature": 0.0}
    status, body = post(server.url + "/generate", {"input_ids": prompt(500, 1), "sampling_params": long_budget})
    assert status == 400 and "exceeds the model's maximum context length" in body["error"]["message"]
    status, body = post(server.url + "/generate", {"input_ids": prompt(MAX_INPUT + 1, 2),
                                                   "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "exceeds the maximum allowed length" in body["error"]["message"]

    async def run():
        async with SGLangGenerator(server.url) as gen:
            capped = await gen.generate(prompt(500, 1), greedy(100))
            longest = await gen.generate(prompt(MAX_INPUT, 2), greedy(100))
            with pytest.raises(ContextLengthExceeded, match=f"a context of {MAX_INPUT + 1} tokens leaves no room"):
                await gen.generate(prompt(MAX_INPUT + 1, 2), greedy(1))
            return capped, longest

    capped, longest = asyncio.run(run())
    # SGLang ends a request at context - 2 tokens in all: 10 new tokens after 500.
    assert capped.finish_reason == "length" and len(capped.token_ids) == CONTEXT - 2 - 500
    assert longest.finish_reason == "length" and 1 <= len(longest.token_ids) <= CONTEXT - MAX_INPUT


def test_an_out_of_vocabulary_id_is_refused_before_it_can_take_the_server_down(server):
    """The vocabulary comes from the served model's config.json (SGLang does not report it)."""
    async def run():
        async with SGLangGenerator(server.url) as gen:
            with pytest.raises(ValueError, match=r"input_ids\[3\] = 320 is outside the model's vocabulary \[0, 320\)"):
                await gen.generate([1, 2, 3, 320], greedy(2))
            return await gen.health(), await gen.generate([1, 2, 3, 319], greedy(2))

    healthy, result = asyncio.run(run())
    assert healthy and len(result.token_ids) == 2


def test_the_prefix_cache_serves_later_turns(server):
    """Token in, token out: each turn's context is the previous turn's plus new ids, so the radix
    cache supplies what was already computed."""
    async def run():
        async with SGLangGenerator(server.url) as gen:
            context, cached = prompt(100, 7), []
            for turn in range(3):
                result = await gen.generate(context, greedy(12))
                cached.append(result.cached_tokens)
                context = context + result.token_ids + prompt(20, 100 + turn)  # the tool's observation
            return cached

    cached = asyncio.run(run())
    assert cached[1] >= 100 and cached[2] > cached[1], cached


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(server, mode):
    """abort: the turn returns its partial output, and continuing from it gives the uninterrupted
    tokens (partial rollout); retract and in_place: the request waits out the pause and finishes
    with the uninterrupted tokens."""
    context, n = prompt(40, 11), 300

    async def run():
        async with SGLangGenerator(server.url) as gen:
            uninterrupted = await gen.generate(context, greedy(n))
            task = asyncio.ensure_future(gen.generate(context, greedy(n)))
            while (await gen.capacity()).running_requests < 1:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # some tokens in
            await gen.pause(mode)
            try:
                await asyncio.sleep(1.0)
                done_while_paused = task.done()
            finally:
                await gen.resume()
            result = await task
            if result.finish_reason == "abort":
                rest = await gen.generate(context + result.token_ids, greedy(n - len(result.token_ids)))
                return uninterrupted, result, result.token_ids + rest.token_ids, done_while_paused
            return uninterrupted, result, result.token_ids, done_while_paused

    uninterrupted, result, tokens, done_while_paused = asyncio.run(run())
    assert uninterrupted.finish_reason == "length" and len(uninterrupted.token_ids) == n
    if mode == "abort":
        assert done_while_paused and result.finish_reason == "abort" and 0 < len(result.token_ids) < n
    else:
        assert not done_while_paused and result.finish_reason == "length"
    assert tokens == uninterrupted.token_ids


def test_both_weight_syncs_make_the_servers_weights_the_trainers(start_sglang, tiny_qwen3_checkpoint, tmp_path):
    """Disk: an HF export and /update_weights_from_disk (the version read from /model_info, where
    0.5.23 keeps it). Distributed: SGLang's own group over gloo, inside its weight-update session.
    After each, greedy generations are the pushed model's."""
    from rstar_jax.train.weight_sync import DiskSync, DistributedSync

    server = start_sglang(tiny_qwen3_checkpoint, context_length=CONTEXT, max_total_tokens=POOL)
    disk_model, wire_model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(5)), Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(6))
    context = prompt(9, 3)

    async def run():
        async with SGLangGenerator(server.url) as gen:
            await DiskSync([gen], tmp_path / "weights", mode="pause", dtype="float32").push(disk_model, 1)
            after_disk = await gen.generate(context, greedy(12)), await gen.weight_version()
            # Without a version: read back, and never an exception after the load.
            await gen.update_weights_from_disk(save_pretrained(disk_model, tmp_path / "again", dtype="float32"))
            unversioned = gen.version
            sync = DistributedSync([gen], dtype="float32", backend="gloo", mode="wait", timeout_s=120)
            try:
                await sync.push(wire_model, 2)
            finally:
                await sync.close()
            after_wire = await gen.generate(context, greedy(12)), await gen.weight_version()
            return after_disk, unversioned, after_wire

    (disk_result, disk_version), unversioned, (wire_result, wire_version) = asyncio.run(run())
    assert disk_version == "1" and disk_result.weight_version == 1 and unversioned == 1
    assert disk_result.token_ids == reference(disk_model, context, 12)[0]
    assert wire_version == "2" and wire_result.weight_version == 2
    tokens, logprobs = reference(wire_model, context, 12)
    assert wire_result.token_ids == tokens
    np.testing.assert_allclose(wire_result.logprobs, logprobs, atol=1e-4)


def test_an_in_place_push_lets_a_running_generation_go_on_with_per_token_versions(start_sglang,
                                                                                  tiny_qwen3_checkpoint, tmp_path):
    """weight_sync.mode "in_place" on SGLang: paused in place, updated from disk without a cache flush
    (SGLang fails an update whose flush finds requests frozen), continued. The running request
    finishes whole, and SGLang's meta_info.weight_versions gives its tokens the old version, then
    the new one."""
    from rstar_jax.train.weight_sync import DiskSync

    server = start_sglang(tiny_qwen3_checkpoint, context_length=CONTEXT, max_total_tokens=POOL)
    context, n = prompt(40, 12), 300

    async def run():
        async with SGLangGenerator(server.url) as gen:
            sync = DiskSync([gen], tmp_path / "weights", mode="in_place", dtype="float32")
            await sync.push(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(5)), 1)
            task = asyncio.ensure_future(gen.generate(context, greedy(n)))
            while (await gen.capacity()).running_requests < 1:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # some tokens in
            await sync.push(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(6)), 2)
            return await task, await gen.weight_version()

    result, version = asyncio.run(run())
    assert version == "2" and result.finish_reason == "length" and len(result.token_ids) == n
    assert result.weight_version == 2 and result.token_versions is not None
    split = result.token_versions.index(2)
    assert 0 < split < n and result.token_versions == (1,) * split + (2,) * (n - split)
