"""The server's JSON (orjson) means what the standard library's meant: the same values read back,
non-finite log-probs still written as NaN / Infinity / -Infinity (orjson alone writes null),
non-string keys as strings, text unescaped; request bodies orjson refuses are still read."""

import asyncio
import json
import math
import types

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from rstar_jax.engine.http_common import dumps, json_floats, json_or_empty, json_response, loads
from rstar_jax.engine.server import EngineServer, _sse

PAYLOADS = [
    {"text": "ünïcödé ∑ 数学 🤖 \"q\" \\ \n", "n": 3, "x": 0.1, "none": None, "ok": True, "list": [1, [2.5, None]]},
    {"lp": [float("-inf"), float("nan"), float("inf"), -0.5], "e2e_latency": 0.25},
    {1: "int key", None: "none key", True: "bool key"},
    [],
    None,
    {"nested": {"deep": [{"v": float("-inf")}]}, "null_too": None},
]


def _stdlib(payload) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


def _same(a, b) -> bool:
    """Equality where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("payload", PAYLOADS)
def test_dumps_reads_back_as_the_standard_librarys(payload):
    ours, theirs = dumps(payload), _stdlib(payload)
    assert _same(json.loads(ours), json.loads(theirs))
    assert _same(loads(ours), json.loads(theirs))  # our reader takes what the standard library wrote
    if not any(t in theirs for t in (b"NaN", b"Infinity")):
        assert b"\\u" not in ours  # UTF-8, as ensure_ascii=False


def test_non_finite_log_probs_keep_the_standard_librarys_tokens():
    logprobs = np.float32([-0.5, -np.inf, np.nan])
    assert dumps(json_floats(logprobs), floats_checked=True) == b"[-0.5,-Infinity,NaN]"
    assert dumps(json_floats([None, float("inf"), -1.25]), floats_checked=True) == b"[null,Infinity,-1.25]"
    # The /generate triples: what the standard library wrote before, value for value.
    triples = EngineServer._triples(types.SimpleNamespace(tokenizer=None), [-0.5, float("-inf")], [7, 8], False)
    written = dumps({"t": triples}, floats_checked=True)
    assert written == b'{"t":[[-0.5,7,null],[-Infinity,8,null]]}'
    assert written.replace(b",", b", ").replace(b":", b": ") == _stdlib({"t": [[-0.5, 7, None], [float("-inf"), 8, None]]})
    assert json.loads(written)["t"][1][0] == float("-inf")
    assert _sse({"t": triples}) == b"data: " + written + b"\n\n" and _sse("[DONE]") == b"data: [DONE]\n\n"


def test_json_response_headers_match_aiohttps():
    ours, theirs = json_response({"a": 1}, status=400), web.json_response({"a": 1}, status=400)
    assert ours.status == theirs.status == 400
    assert ours.content_type == theirs.content_type and ours.charset == theirs.charset == "utf-8"


def test_request_bodies_orjson_refuses_are_still_read():
    assert loads(b'{"x": NaN, "y": -Infinity}')["y"] == float("-inf")
    assert loads('{"é": 1}'.encode("latin-1"), "latin-1") == {"é": 1}
    with pytest.raises(ValueError):
        loads(b"{not json")

    def read(body: bytes):
        request = make_mocked_request("POST", "/x", headers={"Content-Type": "application/json"})
        request._read_bytes = body
        return asyncio.run(json_or_empty(request))

    assert read(b"") == {} and read(b'{"rid": "ab"}') == {"rid": "ab"}
    with pytest.raises(web.HTTPBadRequest):
        read(b"[1]")
    with pytest.raises(web.HTTPBadRequest):
        read(b"{")
