"""SGLang client without a JAX server: the exact /generate format, request payloads, errors and retries."""

import asyncio
import json
import socket

import numpy as np
import orjson
import pytest
from aiohttp import web

from rstar_jax.rollout.protocol import Generator, SamplingParams
from rstar_jax.rollout.protocol import new_rid
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator, parse_generate_response
from rstar_jax.rollout.tokens import TokenArray

# The response example of sglang_api.md §3.3, verbatim in structure and values.
SGLANG_EXAMPLE = """
{
  "text": "...",
  "output_ids": [151667, 198, 151645],
  "meta_info": {
    "id": "0000000000000042",
    "finish_reason": {"type": "stop", "matched": 151645},
    "prompt_tokens": 812,
    "completion_tokens": 3,
    "cached_tokens": 768,
    "weight_version": "default",
    "e2e_latency": 0.21,
    "output_token_logprobs": [[-0.0123, 151667, null], [-0.4410, 198, null], [-0.0002, 151645, null]],
    "output_token_logprobs_length": 3,
    "num_retractions": 0,
    "reasoning_tokens": 0
  }
}
"""


def test_parses_the_documented_generate_response():
    result = parse_generate_response(json.loads(SGLANG_EXAMPLE))
    assert result.token_ids == [151667, 198, 151645]
    assert result.logprobs == [-0.0123, -0.4410, -0.0002]
    assert result.finish_reason == "stop" and result.weight_version == 0  # "default" is not numeric
    assert result.cached_tokens == 768 and result.num_retractions == 0


def test_parses_into_token_arrays_the_same_values():
    """arrays=True (the orjson client's path): the same ids and log-probs, as int32 / float32 buffers
    where the values are float32 ones (SGLang's), float64 where they are not (the example's)."""
    listed = parse_generate_response(json.loads(SGLANG_EXAMPLE))
    result = parse_generate_response(json.loads(SGLANG_EXAMPLE), arrays=True)
    assert isinstance(result.token_ids, TokenArray) and result.token_ids.dtype == np.int32
    assert result == listed and result.logprobs.dtype == np.float64
    body = json.loads(SGLANG_EXAMPLE)
    for triple in body["meta_info"]["output_token_logprobs"]:
        triple[0] = float(np.float32(triple[0]))
    assert parse_generate_response(body, arrays=True).logprobs.dtype == np.float32
    empty = json.loads(SGLANG_EXAMPLE)
    empty["output_ids"], empty["meta_info"]["output_token_logprobs"] = [], []
    assert parse_generate_response(empty, arrays=True) == parse_generate_response(empty)


@pytest.mark.parametrize("arrays", [False, True])
def test_parse_rejects_inconsistent_responses(arrays):
    body = json.loads(SGLANG_EXAMPLE)
    body["meta_info"]["output_token_logprobs"][1][1] = 7
    with pytest.raises(SGLangError, match=r"output_token_logprobs\[1\] is for token 7, output_ids has 198"):
        parse_generate_response(body, arrays=arrays)
    body = json.loads(SGLANG_EXAMPLE)
    del body["meta_info"]["output_token_logprobs"]
    with pytest.raises(SGLangError, match="return_logprob"):
        parse_generate_response(body, arrays=arrays)
    body = json.loads(SGLANG_EXAMPLE)
    body["output_ids"] = None
    with pytest.raises(SGLangError, match="lacks"):
        parse_generate_response(body, arrays=arrays)
    body = json.loads(SGLANG_EXAMPLE)
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "x", "status_code": None, "err_type": None}
    body["meta_info"]["weight_version"] = "12"
    result = parse_generate_response(body, arrays=arrays)
    assert result.finish_reason == "abort" and result.weight_version == 12 and len(result.token_ids) == 3


@pytest.mark.parametrize("answer", ["orjson", "stdlib"])
def test_both_codecs_send_the_same_request_and_read_the_same_result(answer):
    """orjson (the default) and the standard library (codec="json", the old path) put the same JSON
    on the wire and read the same values back, whichever library wrote the answer. A standard-library
    server may write -Infinity / NaN log-probs, which orjson refuses: the client reads them all the same."""
    seen = []

    async def generate(request):
        seen.append((request.content_type, await request.json()))
        body = json.loads(SGLANG_EXAMPLE)
        body["meta_info"]["output_token_logprobs"][1][0] = float("-inf")
        if answer == "orjson":  # orjson writes non-finite floats as null: only finite ones here
            body["meta_info"]["output_token_logprobs"][1][0] = -1.5
            return web.Response(body=orjson.dumps(body), content_type="application/json")
        return web.json_response(body)

    async def run(codec, ids):
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, url = await _serve(app)
        try:
            async with SGLangGenerator(url, codec=codec) as gen:
                return await gen.generate(ids, SamplingParams(max_new_tokens=5, seed=3), rid="cd" * 8)
        finally:
            await runner.cleanup()

    fast = asyncio.run(run("orjson", TokenArray([1, 2, 151644])))
    fast_from_list = asyncio.run(run("orjson", [1, 2, 151644]))
    slow = asyncio.run(run("json", [1, 2, 151644]))
    assert fast == slow == fast_from_list and isinstance(fast.token_ids, TokenArray) and type(slow.token_ids) is list
    assert fast.logprobs[1] == slow.logprobs[1] == (-1.5 if answer == "orjson" else float("-inf"))
    assert seen[0] == seen[1] == seen[2] and seen[0][0] == "application/json"
    assert seen[0][1]["input_ids"] == [1, 2, 151644] and seen[0][1]["sampling_params"]["sampling_seed"] == 3


def test_rids_are_fixed_width_hex():
    rids = {new_rid() for _ in range(100)}
    assert len(rids) == 100 and {len(r) for r in rids} == {16} and all(int(r, 16) >= 0 for r in rids)


async def _serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_request_always_carries_the_sampling_fields_and_retries_unavailable():
    """A stub server records the request; it answers 503 twice, then the §3.3 example."""
    seen = []

    async def generate(request):
        seen.append(await request.json())
        if len(seen) <= 2:
            return web.Response(status=503)
        return web.json_response(json.loads(SGLANG_EXAMPLE))

    async def run():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, url = await _serve(app)
        try:
            async with SGLangGenerator(url, retries=3, backoff_s=0.01) as gen:
                assert isinstance(gen, Generator)
                return await gen.generate([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9,
                                                                     top_k=20, stop_token_ids=(9,)), rid="ab" * 8)
        finally:
            await runner.cleanup()

    result = asyncio.run(run())
    assert result.token_ids == [151667, 198, 151645] and len(seen) == 3
    body = seen[-1]
    assert body["input_ids"] == [1, 2, 3] and body["rid"] == "ab" * 8 and body["return_logprob"] is True
    params = body["sampling_params"]
    assert (params["max_new_tokens"], params["temperature"], params["top_p"], params["top_k"]) == (5, 0.7, 0.9, 20)
    assert params["stop_token_ids"] == [9] and params["n"] == 1


def test_unreachable_server_fails_clearly_after_bounded_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        async with SGLangGenerator(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as gen:
            await gen.server_info()

    with pytest.raises(SGLangError, match=r"/get_server_info: failed after 3 attempt\(s\)"):
        asyncio.run(run())


def test_client_error_is_not_retried_and_names_the_message():
    calls = []

    async def generate(request):
        calls.append(1)
        return web.json_response({"error": {"message": "input_ids: 9000 tokens do not fit"}}, status=400)

    async def run():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, url = await _serve(app)
        try:
            async with SGLangGenerator(url, retries=3, backoff_s=0.01) as gen:
                await gen.generate([1], SamplingParams(max_new_tokens=1))
        finally:
            await runner.cleanup()

    with pytest.raises(SGLangError, match="HTTP 400: input_ids: 9000 tokens do not fit"):
        asyncio.run(run())
    assert len(calls) == 1
