"""`python -m rstar_jax.serve` over real HTTP on loopback, driven by the SGLang client: every endpoint
of the minimum surface, SGLang's response format, aborts, pause, and weight updates from disk."""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rollout.protocol import SamplingParams
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator
from rstar_jax.train.weight_sync import sync_weights_via_disk
from tests.engine.test_engine import _reference

pytestmark = pytest.mark.slow  # a `rstar_jax.serve` subprocess

CONFIG = Qwen3Config.tiny()
SLOTS, MAX_LENGTH, POOL, PAGE = 2, 512, 768, 16  # a pool below slots x context: overcommitted
CHUNK = 64  # --chunked-prefill-size: recomputes after a retraction are prefilled in chunks
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
LONG = SamplingParams(max_new_tokens=480, temperature=0.0)


@pytest.fixture(scope="module")
def server():
    with LocalServer("tiny", slots=SLOTS, max_length=MAX_LENGTH, max_total_tokens=POOL, page_size=PAGE, seed=0,
                     extra_args=("--chunked-prefill-size", str(CHUNK))) as s:
        yield s


def _http(server, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, n).tolist()


async def _until_running(gen, n=1):
    while (await gen.capacity()).running_requests < n:
        await asyncio.sleep(0.002)


def test_generate_returns_sglang_format_and_matches_the_full_forward(server):
    prompt = _prompt(9, 1)
    tokens, logprobs = _reference(Qwen3(CONFIG, rngs=nnx.Rngs(0)), prompt, 6)
    status, text = _http(server, "POST", "/generate", {
        "input_ids": prompt, "rid": "00000000000000a1", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                            "stop_token_ids": [tokens[3]], "skip_special_tokens": False, "no_stop_trim": True}})
    assert status == 200
    body = json.loads(text)
    meta = body["meta_info"]
    assert body["output_ids"] == tokens[:4]
    assert meta["id"] == "00000000000000a1"
    assert meta["finish_reason"] == {"type": "stop", "matched": tokens[3]}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (9, 4, 0)
    assert meta["weight_version"] == "0" and meta["e2e_latency"] > 0
    assert [t[1] for t in meta["output_token_logprobs"]] == tokens[:4]
    assert all(t[2] is None for t in meta["output_token_logprobs"])
    np.testing.assert_allclose([t[0] for t in meta["output_token_logprobs"]], logprobs[:4], atol=1e-5)

    async def via_client():
        async with SGLangGenerator(server.url) as gen:
            return await gen.generate(prompt, GREEDY)

    result = asyncio.run(via_client())
    assert result.token_ids == tokens and result.finish_reason == "length"
    np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-5)
    status, text = _http(server, "POST", "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and json.loads(text)["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert "output_token_logprobs" not in json.loads(text)["meta_info"]  # return_logprob defaults to false
    # As sglang-router 0.3.2 forwards it: its own fields at their defaults, routing hints.
    status, text = _http(server, "POST", "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}, "model": None,
        "background": False, "no_logs": False, "return_bytes": False, "routing_key": "abc", "stream": False})
    assert status == 200 and json.loads(text)["output_ids"] == tokens[:2]


def test_a_prompt_longer_than_the_prefill_chunk_matches_the_full_forward(server):
    prompt = _prompt(100, 7)  # prefilled as 64 + 36 tokens
    tokens, logprobs = _reference(Qwen3(CONFIG, rngs=nnx.Rngs(0)), prompt, 6)

    async def run():
        async with SGLangGenerator(server.url) as gen:
            return await gen.generate(prompt, GREEDY)

    result = asyncio.run(run())
    assert result.token_ids == tokens
    np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)


def test_bad_requests_name_the_field(server):
    cases = [
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [1] * MAX_LENGTH}, "do not fit the context length"),
        ({"input_ids": [CONFIG.vocab_size]}, "outside"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field"),
        ({"text": "hi"}, "text needs a tokenizer"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1], "bogus": 1}, "unknown field(s) ['bogus']"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [1], "return_text_in_logprobs": True}, "return_text_in_logprobs needs a tokenizer"),
        # SGLang refuses an explicit max_new_tokens past the context length (it does not cut it).
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": MAX_LENGTH - 9}},
         "exceeds the model's maximum context length"),
        ({"input_ids": [1], "background": True}, "background=True is not supported"),
        ({"input_ids": [1], "model": "another-model"}, "model='another-model'"),
    ]
    for body, message in cases:
        status, text = _http(server, "POST", "/generate", body)
        assert status == 400 and message in text, (body, text)
    # The OpenAI routes need a tokenizer: this server (a preset model) has none, as --skip-tokenizer-init.
    status, text = _http(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert status == 400 and "needs a tokenizer" in text


def test_info_load_health_and_memory_endpoints(server):
    async def run():
        async with SGLangGenerator(server.url) as gen:
            info = await gen.server_info()
            loads = await gen.loads()
            capacity = await gen.capacity()
            return info, loads, capacity, await gen.health(), await gen.weight_version()

    info, loads, capacity, healthy, version = asyncio.run(run())
    assert info["max_total_num_tokens"] == POOL == capacity.total_tokens and info["page_size"] == PAGE
    assert info["max_req_input_len"] == MAX_LENGTH and info["max_running_requests"] == SLOTS
    assert info["chunked_prefill_size"] == CHUNK
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == POOL
    assert loads[0]["num_running_reqs"] == 0 and loads[0]["max_total_num_tokens"] == POOL
    assert healthy and version == "0" and info["vocab_size"] == CONFIG.vocab_size
    assert (capacity.context_length, capacity.max_input_tokens) == (MAX_LENGTH, MAX_LENGTH - 1)
    status, text = _http(server, "GET", "/get_load")
    assert status == 200 and json.loads(text)[0]["num_reqs"] == 0
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert _http(server, "POST", path, {"tags": None}) == (200, "null")
    assert _http(server, "GET", "/flush_cache")[0] == 200


def test_abort_by_rid_prefix_returns_partial_output_and_flush_refuses_while_busy(server):
    async def run():
        async with SGLangGenerator(server.url) as gen:
            task = asyncio.ensure_future(gen.generate(_prompt(5, 2), LONG, rid="c0ffee0000000001"))
            await _until_running(gen)
            flush_status = await asyncio.to_thread(_http, server, "POST", "/flush_cache")
            await gen.abort("c0ffee")
            return await task, flush_status

    result, (flush_status, _) = asyncio.run(run())
    assert flush_status == 400
    assert result.finish_reason == "abort" and 1 <= len(result.token_ids) < LONG.max_new_tokens
    assert len(result.logprobs) == len(result.token_ids)
    assert _http(server, "POST", "/abort_request", {"rid": "", "abort_all": False}) == (200, "")


def test_pause_aborts_running_and_holds_new_requests(server):
    async def run():
        async with SGLangGenerator(server.url) as gen:
            running = asyncio.ensure_future(gen.generate(_prompt(5, 3), LONG))
            await _until_running(gen)
            await gen.pause("abort")
            aborted = await running
            held = asyncio.ensure_future(gen.generate(_prompt(5, 4), GREEDY))
            while (await gen.capacity()).queued_requests < 1:
                await asyncio.sleep(0.002)
            healthy_while_paused = await gen.health()
            await gen.resume()
            return aborted, await held, healthy_while_paused

    aborted, held, healthy_while_paused = asyncio.run(run())
    assert aborted.finish_reason == "abort" and held.finish_reason == "length" and len(held.token_ids) == 6
    assert not healthy_while_paused
    status, text = _http(server, "POST", "/pause_generation", {"mode": "freeze"})
    assert status == 400 and "mode" in text and "retract" in text


def test_pause_retract_recomputes_on_continue_and_reports_the_retraction(server):
    """retract mode frees the running request's KV (the queue section of /v1/loads shows it); after
    /continue_generation it is recomputed and ends with the output of an uninterrupted run. The next
    turn of that conversation reuses its KV from the prefix cache."""
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=11)
    prompt = _prompt(9, 6)

    async def run():
        async with SGLangGenerator(server.url) as gen:
            expected = await gen.generate(prompt, params)
            running = asyncio.ensure_future(gen.generate(prompt, params))
            await _until_running(gen)
            await gen.pause("retract")
            status, text = await asyncio.to_thread(_http, server, "GET", "/v1/loads?include=queues")
            await gen.resume()
            retracted = await running
            next_turn = await gen.generate(prompt + retracted.token_ids + [5, 6], GREEDY)
            return expected, retracted, status, json.loads(text)["loads"][0], next_turn, await gen.loads()

    expected, retracted, status, load, next_turn, loads = asyncio.run(run())
    assert next_turn.cached_tokens == len(prompt) + 200 - 1 and loads[0]["cache_hit_rate"] > 0
    assert status == 200 and load["queues"]["retracted"] == 1 and load["num_running_reqs"] == 0
    assert load["num_used_tokens"] == 0
    assert retracted.num_retractions == 1 and expected.num_retractions == 0
    assert retracted.finish_reason == "length" and retracted.token_ids == expected.token_ids


def test_a_per_layer_server_matches_the_full_forward_and_takes_disk_updates(tmp_path):
    """`--layer-layout per_layer`: reported in /get_server_info; greedy tokens and log-probs of the
    full forward; a disk update reaches the per-layer weights."""
    original, other = Qwen3(CONFIG, rngs=nnx.Rngs(0)), Qwen3(CONFIG, rngs=nnx.Rngs(1))
    prompt = _prompt(11, 9)

    async def run(url):
        async with SGLangGenerator(url) as gen:
            info = await gen.server_info()
            before = await gen.generate(prompt, GREEDY)
            await sync_weights_via_disk(other, [gen], tmp_path / "weights", version=3, mode="wait")
            return info, before, await gen.generate(prompt, GREEDY)

    with LocalServer("tiny", slots=SLOTS, max_length=128, page_size=PAGE, seed=0,
                     extra_args=("--layer-layout", "per_layer")) as s:
        info, before, after = asyncio.run(run(s.url))
    assert info["layer_layout"] == "per_layer"
    tokens, logprobs = _reference(original, prompt, 6)
    assert before.token_ids == tokens
    np.testing.assert_allclose(before.logprobs, logprobs, atol=1e-5)
    assert after.token_ids == _reference(other, prompt, 6)[0] != tokens and after.weight_version == 3


def test_weight_sync_via_disk(server, tmp_path):
    """Abort mode: a running request returns partial output; new outputs come from the new weights."""
    original = Qwen3(CONFIG, rngs=nnx.Rngs(0))
    other = Qwen3(CONFIG, rngs=nnx.Rngs(1))
    prompt = _prompt(7, 5)

    async def run():
        async with SGLangGenerator(server.url) as gen:
            running = asyncio.ensure_future(gen.generate(_prompt(5, 6), LONG))
            await _until_running(gen)
            await sync_weights_via_disk(other, [gen], tmp_path / "weights", version=7, mode="abort")
            interrupted = await running
            after = await gen.generate(prompt, GREEDY)
            reported = await gen.weight_version()
            # "wait" mode with nothing running, back to the original weights.
            await sync_weights_via_disk(original, [gen], tmp_path / "weights", version=8, mode="wait")
            restored = await gen.generate(prompt, GREEDY)
            with pytest.raises(SGLangError, match="update_weights_from_disk"):
                await gen.update_weights_from_disk(tmp_path / "missing")
            return interrupted, after, reported, restored, gen.version

    interrupted, after, reported, restored, version = asyncio.run(run())
    assert interrupted.finish_reason == "abort" and len(interrupted.token_ids) < LONG.max_new_tokens
    assert reported == "7" and after.weight_version == 7
    assert after.token_ids == _reference(other, prompt, 6)[0]
    assert restored.token_ids == _reference(original, prompt, 6)[0] != after.token_ids
    assert restored.weight_version == 8 == version
