"""What both halves of the SGLang client share: the errors a server's answers map to, the statuses
they are told apart by, and how an error body reads (`rstar_jax.rollout.sglang` and
`rstar_jax.rollout.sglang_weights` import it; neither imports the other's user)."""

from __future__ import annotations

from typing import Any

from rstar_jax.rollout.protocol import GeneratorError, GeneratorUnavailable, RequestRejected

RETRY_STATUSES = (502, 503, 504)
ABSENT_STATUSES = (404, 405)  # a route this server version does not have
LOAD_ROUTES = ("/v1/loads?include=core", "/get_load", "/get_server_info")


class SGLangError(GeneratorError):
    """A server could not be reached after retries, or answered with an error."""


class SGLangUnavailable(SGLangError, GeneratorUnavailable):
    """The server refused connections, timed out or answered 5xx (after the retries allowed)."""


class SGLangRejected(SGLangError, RequestRejected):
    """The server refused this request with a 4xx (e.g. a prompt longer than its context)."""


def error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]
