"""What the native routes of `rstar_jax.serve` share (`rstar_jax.engine.server` and the route
modules it composes): the bad-request error, SGLang's error body, the JSON body reader and the JSON
writer.

JSON goes through orjson both ways (as SGLang's own server), with the standard library's meaning
kept where the two differ:
- non-finite floats: the standard library writes NaN / Infinity / -Infinity, orjson writes null.
  `dumps` writes them as the standard library did: a payload orjson wrote with a null in it is
  searched for non-finite floats and, if it has any, written by the standard library. The hot
  /generate path instead passes its log-probs through `json_floats` (the same tokens, as orjson
  fragments) and skips the search (`floats_checked=True`).
- non-string dict keys are written as strings (OPT_NON_STR_KEYS), as the standard library does;
- text is UTF-8, never \\u-escaped (the standard library with ensure_ascii=False): the same JSON;
- reading: NaN / Infinity tokens, which orjson refuses, are read by the standard library.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
import orjson
from aiohttp import web

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
# The standard library's tokens for non-finite floats, as orjson fragments (written verbatim).
_NAN, _INF, _NEG_INF = orjson.Fragment(b"NaN"), orjson.Fragment(b"Infinity"), orjson.Fragment(b"-Infinity")


class BadRequest(ValueError):
    """A request field is invalid; answered with HTTP 400 naming the field."""


def json_floats(values: Sequence[float | None] | np.ndarray) -> list:
    """`values` as a list of Python floats for `dumps(..., floats_checked=True)`: a non-finite one as
    the standard library's token (NaN, Infinity, -Infinity), None kept. Vectorised: one numpy pass."""
    array = np.asarray(values, dtype=np.float64) if len(values) else np.zeros(0)
    out = array.tolist()
    bad = np.flatnonzero(~np.isfinite(array))
    for i in bad.tolist():
        if not isinstance(values, np.ndarray) and values[i] is None:
            out[i] = None
        else:
            out[i] = _NAN if math.isnan(out[i]) else _INF if out[i] > 0 else _NEG_INF
    return out


def _has_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_nonfinite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_nonfinite(v) for v in value)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return not bool(np.isfinite(value).all())
    return False


def dumps(payload: Any, *, floats_checked: bool = False) -> bytes:
    """`payload` as JSON bytes (orjson), with the standard library's meaning (module docstring).
    floats_checked: every float that may be non-finite went through `json_floats` (no search)."""
    data = orjson.dumps(payload, option=_OPTIONS)
    if floats_checked or b"null" not in data or not _has_nonfinite(payload):
        return data
    return json.dumps(payload, ensure_ascii=False).encode()


def loads(raw: bytes, charset: str | None = None) -> Any:
    """A JSON request body: orjson, else the standard library (NaN / Infinity tokens, other
    charsets); raises ValueError for what is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw.decode(charset or "utf-8"))


def json_response(payload: Any, *, status: int = 200, floats_checked: bool = False) -> web.Response:
    """aiohttp's `web.json_response`, written by `dumps` (same content type and charset)."""
    return web.Response(body=dumps(payload, floats_checked=floats_checked), status=status,
                        content_type="application/json", charset="utf-8")


async def request_json(request: web.Request) -> Any:
    """The request body as JSON (`loads`); ValueError when it is not."""
    return loads(await request.read(), request.charset)


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's error body (OpenAI's `error` object with SGLang's fields beside it)."""
    return json_response({"error": {"message": message}, "object": "error", "message": message,
                          "type": "BadRequest" if status == 400 else "Error", "code": status}, status=status)


async def json_or_empty(request: web.Request) -> dict:
    """The request's JSON object, {} for an empty body; 400 for anything else."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = loads(raw, request.charset)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body must be JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body
