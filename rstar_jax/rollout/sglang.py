"""Async client for SGLang servers (and `python -m rstar_jax.serve`), implementing `Generator`.

Data plane: `generate` posts token ids to `/generate`, always sending temperature, top_p, top_k and
max_new_tokens (SGLang otherwise takes them from the model's generation_config), and parses
`output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text] triples) and
`meta_info.finish_reason`. An aborted request comes back as a normal result with finish reason
"abort" and its partial tokens; the caller decides whether to resume it.

Control plane: `server_info`, `loads`, `flush_cache`, `pause`, `resume`, `update_weights_from_disk`,
`weight_version`, `abort_all`. The trainer's weight sync (`rstar_jax.train.weight_sync.DiskSync`)
exports Hugging Face safetensors and makes every server load them through this client.

Errors: connection failures and HTTP 502/503/504 are retried a bounded number of times with
exponential backoff, then raise `SGLangError` naming the server, endpoint and last error; HTTP 4xx
raises at once with the server's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from typing import Any, Sequence

import aiohttp

from rstar_jax.rollout.protocol import FINISH_REASONS, Capacity, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

RID_HEX_DIGITS = 16  # fixed width: SGLang aborts by rid prefix, so no rid may prefix another
RETRY_STATUSES = (502, 503, 504)


class SGLangError(RuntimeError):
    """A server could not be reached after retries, or answered with an error."""


def new_rid() -> str:
    """A random fixed-width hex request id."""
    return secrets.token_hex(RID_HEX_DIGITS // 2)


def parse_weight_version(value: Any) -> int | None:
    """SGLang's weight_version is a free string; numeric ones map to the policy version."""
    try:
        return int(str(value))
    except ValueError:
        return None


def parse_generate_response(body: dict, *, url: str = "server") -> GenerateResult:
    """Turns one `/generate` JSON object (SGLang's non-streaming response) into a GenerateResult."""
    try:
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
        finish = meta["finish_reason"]
    except (KeyError, TypeError) as e:
        raise SGLangError(f"{url}: /generate response lacks {e}: {str(body)[:300]}") from e
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise SGLangError(f"{url}: /generate response has no meta_info.output_token_logprobs "
                          "(the request must set return_logprob)")
    if len(triples) != len(output_ids):
        raise SGLangError(f"{url}: {len(output_ids)} output_ids but {len(triples)} output_token_logprobs")
    logprobs = []
    for i, (triple, token) in enumerate(zip(triples, output_ids)):
        if int(triple[1]) != token:
            raise SGLangError(f"{url}: output_token_logprobs[{i}] is for token {triple[1]}, output_ids has {token}")
        logprobs.append(float(triple[0]))
    if finish is None:
        raise SGLangError(f"{url}: /generate returned an unfinished (streaming) chunk")
    reason = finish.get("type") if isinstance(finish, dict) else str(finish)
    if reason not in FINISH_REASONS:
        raise SGLangError(f"{url}: unknown finish_reason {finish!r}")
    version = parse_weight_version(meta.get("weight_version"))
    return GenerateResult(output_ids, logprobs, reason, version if version is not None else 0,
                          num_retractions=int(meta.get("num_retractions") or 0),
                          cached_tokens=int(meta.get("cached_tokens") or 0))


def sampling_payload(sampling: SamplingParams) -> dict:
    """SGLang sampling_params with every distribution-defining field set explicitly."""
    payload = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": 0.0,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "n": 1,
    }
    if sampling.seed is not None:
        payload["sampling_seed"] = sampling.seed
    return payload


class SGLangGenerator:
    """One SGLang(-compatible) server. Use as `async with SGLangGenerator(url) as gen:` or call close()."""

    def __init__(self, base_url: str, *, retries: int = 3, backoff_s: float = 0.5,
                 request_timeout_s: float | None = None, connect_timeout_s: float = 10.0,
                 max_connections: int = 1024):
        if retries < 0:
            raise ValueError(f"SGLangGenerator: retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.name = f"sglang@{self.base_url}"
        self.retries = retries
        self.backoff_s = backoff_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._version = 0
        self._capacity_tokens: int | None = None

    # -- session / transport ------------------------------------------------------------------
    async def __aenter__(self) -> "SGLangGenerator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    async def _request(self, method: str, path: str, payload: dict | None = None, *,
                       retry: bool = True, idempotent: bool = True,
                       ok_statuses: Sequence[int] = (200,)) -> tuple[int, Any]:
        """Sends one request with bounded retries; returns (status, parsed JSON or text).

        A non-idempotent request is retried only when it cannot have reached the server (connection
        refused / unreachable, or 503 before admission)."""
        url = self.base_url + path
        attempts = 1 + (self.retries if retry else 0)
        last_error, tried = "", 0
        for attempt in range(attempts):
            tried = attempt + 1
            try:
                async with self._get_session().request(method, url, json=payload) as response:
                    text = await response.text()
                    retryable = RETRY_STATUSES if idempotent else (503,)
                    if response.status in retryable and attempt + 1 < attempts:
                        last_error = f"HTTP {response.status}: {text[:200]}"
                    else:
                        body = _maybe_json(text)
                        if response.status not in ok_statuses:
                            raise SGLangError(f"{url}: HTTP {response.status}: {_error_message(body)}")
                        return response.status, body
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                last_error = f"{type(e).__name__}: {e}"
                if attempt + 1 >= attempts or not (idempotent or isinstance(e, aiohttp.ClientConnectorError)):
                    break
            delay = self.backoff_s * 2 ** attempt
            log.warning("%s failed (%s); retry %d/%d in %.1fs", url, last_error, attempt + 1, attempts - 1, delay)
            await asyncio.sleep(delay)
        raise SGLangError(f"{url}: failed after {tried} attempt(s): {last_error}")

    # -- Generator ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The numeric weight_version the server last reported."""
        return self._version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("generate: input_ids must be non-empty")
        payload = {"input_ids": ids, "sampling_params": sampling_payload(sampling), "return_logprob": True,
                   "logprob_start_len": -1, "rid": rid or new_rid(), "stream": False}
        # Not idempotent: a request the server accepted may already be running, so only failures to
        # connect are retried.
        _, body = await self._request("POST", "/generate", payload, idempotent=False)
        if isinstance(body, list):
            if len(body) != 1:
                raise SGLangError(f"{self.base_url}/generate: expected one result, got {len(body)}")
            body = body[0]
        result = parse_generate_response(body, url=self.base_url)
        version = parse_weight_version(body["meta_info"].get("weight_version"))
        if version is not None:
            self._version = version
        return result

    async def abort(self, rid: str) -> None:
        """Aborts requests whose rid starts with `rid`; they return their partial output."""
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": False})

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def capacity(self) -> Capacity:
        """KV pool size from /get_server_info (cached) and current use from /v1/loads."""
        if self._capacity_tokens is None:
            info = await self.server_info()
            self._capacity_tokens = int(info["max_total_num_tokens"])
        loads = await self.loads()
        return Capacity(
            total_tokens=self._capacity_tokens,
            used_tokens=sum(int(r.get("num_used_tokens", 0)) for r in loads),
            running_requests=sum(int(r.get("num_running_reqs", 0)) for r in loads),
            queued_requests=sum(int(r.get("num_waiting_reqs", 0)) for r in loads))

    # -- control plane ------------------------------------------------------------------------
    async def server_info(self) -> dict:
        _, body = await self._request("GET", "/get_server_info")
        if not isinstance(body, dict) or "max_total_num_tokens" not in body:
            raise SGLangError(f"{self.base_url}/get_server_info: no max_total_num_tokens in {str(body)[:200]}")
        return body

    async def loads(self) -> list[dict]:
        """Per-DP-rank load snapshots; accepts a bare list or a {"loads": [...]} envelope."""
        _, body = await self._request("GET", "/v1/loads?include=core")
        if isinstance(body, dict):
            body = body.get("loads", [body])
        if not isinstance(body, list):
            raise SGLangError(f"{self.base_url}/v1/loads: unexpected response {str(body)[:200]}")
        return body

    async def health(self) -> bool:
        """True when the server completes a generation (/health_generate answers 200)."""
        try:
            status, _ = await self._request("GET", "/health_generate", retry=False, ok_statuses=(200, 503))
        except SGLangError:
            return False
        return status == 200

    async def flush_cache(self, *, attempts: int = 20, interval_s: float = 0.5) -> None:
        """Flushes the prefix cache; SGLang refuses (400) while requests run, so this retries."""
        for _ in range(attempts):
            status, body = await self._request("POST", "/flush_cache", ok_statuses=(200, 400))
            if status == 200:
                return
            await asyncio.sleep(interval_s)
        raise SGLangError(f"{self.base_url}/flush_cache: still busy after {attempts} attempts: {body}")

    async def pause(self, mode: str = "abort") -> None:
        """Pauses generation; new requests wait. "abort": running requests return partial output;
        "retract": they go back to the queue and are recomputed after `resume`; "in_place": they freeze."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def weight_version(self) -> str:
        _, body = await self._request("GET", "/get_weight_version")
        return str(body["weight_version"])

    async def update_weights_from_disk(self, model_path: str | os.PathLike, *, abort_all_requests: bool = False,
                                       weight_version: str | int | None = None, flush_cache: bool = True) -> dict:
        """Makes the server load an HF checkpoint directory.

        Without `abort_all_requests` (and unless paused) the server first lets running requests finish.
        """
        payload: dict[str, Any] = {"model_path": os.fspath(model_path), "abort_all_requests": abort_all_requests,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        _, body = await self._request("POST", "/update_weights_from_disk", payload, retry=False)
        if not isinstance(body, dict) or not body.get("success"):
            raise SGLangError(f"{self.base_url}/update_weights_from_disk failed: {body}")
        version = parse_weight_version(weight_version) if weight_version is not None else None
        if version is None:
            version = parse_weight_version(await self.weight_version())
        if version is not None:
            self._version = version
        return body


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]


__all__ = ["SGLangError", "SGLangGenerator", "new_rid", "parse_generate_response", "sampling_payload"]
