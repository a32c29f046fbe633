"""What the native routes of `rstar_jax.serve` share (`rstar_jax.engine.server` and the route
modules it composes): the bad-request error, SGLang's error body, and the JSON body reader."""

from __future__ import annotations

import json

from aiohttp import web


class BadRequest(ValueError):
    """A request field is invalid; answered with HTTP 400 naming the field."""


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's error body (OpenAI's `error` object with SGLang's fields beside it)."""
    return web.json_response({"error": {"message": message}, "object": "error", "message": message,
                              "type": "BadRequest" if status == 400 else "Error", "code": status}, status=status)


async def json_or_empty(request: web.Request) -> dict:
    """The request's JSON object, {} for an empty body; 400 for anything else."""
    text = await request.text()
    if not text:
        return {}
    try:
        body = json.loads(text)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body must be JSON: {e}") from e
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body
