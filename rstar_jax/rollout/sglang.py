"""Async client for SGLang servers (and `python -m rstar_jax.serve`), implementing `Generator`.

Data plane: `generate` posts token ids to `/generate`, always sending temperature, top_p, top_k and
max_new_tokens (SGLang otherwise takes them from the model's generation_config), and parses
`output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text] triples) and
`meta_info.finish_reason`. An aborted request comes back as a normal result with finish reason
"abort" and its partial tokens; the caller decides whether to resume it. Before sending, a request is
fitted to the server (its `/get_server_info`, read once): `max_new_tokens` is capped at the context
length less the input (SGLang answers 400 to more), an input with no room left raises
`ContextLengthExceeded` unsent, and an input id outside the model's vocabulary raises `ValueError`
unsent (a real server's embedding fails on it and the server goes down).

Control plane: `server_info`, `loads`, `capacity`, `flush_cache`, `pause`, `resume`,
`update_weights_from_disk`, `weight_version`, `abort_all`, `health` and `wait_ready`; SGLang's
distributed weight update (`weight_update_ranks`, `init_weights_update_group`,
`update_weights_from_distributed`, `destroy_weights_update_group`) and `get_weights_by_name`, with
SGLang's request bodies (those routes, with pause/continue and flush, are in `sglang_weights`, mixed
into the client). The trainer's weight sync (`rstar_jax.train.weight_sync`: `DiskSync` exports
Hugging Face safetensors, `DistributedSync` broadcasts over torch.distributed) drives every server
through this client, once the server has answered `/health_generate`.

SGLang 0.5.x versions differ; each client detects its server once and remembers the outcome:
- Load: `GET /v1/loads?include=core` (2026 builds, one snapshot per DP rank), else `GET /get_load`
  (late-2025 builds: a list of `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}`), else only
  `/get_server_info` (no usage; zero is assumed). A 404/405 marks a route absent.
- Capacity: the KV pool is per DP rank, so `capacity().total_tokens` sums every rank's
  `max_total_num_tokens` (from its snapshot, else `/get_server_info`'s value times `dp_size`) and
  `used_tokens` sums every rank's use.
- Pause: 2026 builds take `{"mode": ...}`; late-2025 builds take no body and only abort. A server that
  refuses the body (4xx) is asked again without one for mode "abort"; other modes then raise.
- Seeded sampling: SGLang honours `sampling_seed` only with `--enable-deterministic-inference`; the
  first seeded request logs a warning (once per server) when `/get_server_info` shows it off.
- Weight version: `/model_info` (0.5.23 has no `/get_weight_version`), else `/get_weight_version`,
  else `/get_server_info`'s startup value. A disk update that loaded never raises for want of it.
- Per-token versions: a request that an in-place weight update crossed comes back from SGLang
  0.5.23 (and `rstar_jax.serve`) with `meta_info.weight_versions`, spans of output tokens per
  version, which become `GenerateResult.token_versions`. A server without them that reports a newer
  version than the request was sent under, after this client paused it in place, gets every token
  labelled with the older version: staleness is overstated, never understated.

Wire format: request bodies and responses go through orjson (`codec="orjson"`, the default; SGLang
itself answers with orjson): input ids leave as the TokenArray (or numpy array) they are held in,
without a Python list, and a response's ids and log-probs come back as TokenArrays (int32 ids,
float32 log-probs, each wider where a value needs it). A response orjson refuses (NaN or Infinity
tokens, which only a standard-library server writes) is read by the standard library instead.
`codec="json"` keeps the path before: the standard library through aiohttp's `json=`, Python lists
of ids and log-probs (the baseline `benchmarks/host_rollout.py` measures beside it).

Transport: with the orjson codec, `/generate` to a plain-HTTP server goes through a lean HTTP/1.1
client (`rstar_jax.rollout.http1`: kept-alive connections pooled per server, up to
`max_connections`, the same connect and total timeouts), about half the CPU of aiohttp's per request;
the control plane, https URLs and `codec="json"` use aiohttp. Its failures are classified as
aiohttp's are: a refused connection is retried, a broken one after the request was written is not.

Errors: connection failures and HTTP 502/503/504 are retried a bounded number of times with
exponential backoff (a `/generate` only when it cannot have reached the server), then raise
`SGLangUnavailable` naming the server, endpoint and last error; so do other 5xx answers and timeouts
(`request_timeout_s`). HTTP 4xx raises `SGLangRejected` at once with the server's message, as does a
generation the server ends with an abort carrying a 4xx status (SGLang's validation aborts). Both are
`SGLangError`s and, for the rollout loop, `GeneratorUnavailable` / `RequestRejected`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import operator
import pathlib
from typing import Any, Sequence

import aiohttp
import numpy as np
import orjson
import yarl

from rstar_jax.rollout.protocol import (
    FINISH_REASONS,
    Capacity,
    ContextLengthExceeded,
    GenerateResult,
    SamplingParams,
    new_rid,
)
from rstar_jax.rollout.http1 import Http1Pool, HttpConnectError, HttpError
from rstar_jax.rollout.tokens import TokenArray
from rstar_jax.rollout.sglang_errors import (  # noqa: F401  (re-exported)
    ABSENT_STATUSES,
    LOAD_ROUTES,
    RETRY_STATUSES,
    SGLangError,
    SGLangRejected,
    SGLangUnavailable,
    error_message,
)
# The weight-update and pause routes live in their own module (a mixin); its constants and version
# parsing stay importable from here.
from rstar_jax.rollout.sglang_weights import (  # noqa: F401  (re-exported)
    BODY_REJECTED_STATUSES,
    WEIGHT_VERSION_ROUTES,
    SGLangWeightsMixin,
    parse_weight_version,
)

log = logging.getLogger(__name__)

_warned_nondeterministic: set[str] = set()  # servers already warned about (once per process)

# The JSON codec of a client (`SGLangGenerator(codec=...)`): "orjson" (the default: bytes both ways,
# numpy input ids serialised natively, TokenArrays out) or "json" (the standard library through
# aiohttp, Python lists out: the path before orjson, kept as a baseline).
CODECS = ("orjson", "json")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_JSON_HEADERS = {"Content-Type": "application/json"}
_LEAN_ROUTES = frozenset({"/generate"})  # what the lean HTTP/1.1 client sends (the rollout's hot path)


def parse_generate_response(body: dict, *, url: str = "server", arrays: bool = False) -> GenerateResult:
    """Turns one `/generate` JSON object (SGLang's non-streaming response) into a GenerateResult.
    arrays: token ids and log-probs as TokenArrays (int32 and float32, wider where a value needs it),
    read with numpy; else Python lists, element by element."""
    try:
        meta = body["meta_info"]
        output_ids = body["output_ids"]
        output_ids = (_id_array(output_ids) if arrays else [int(t) for t in output_ids])
        finish = meta["finish_reason"]
    except (KeyError, TypeError) as e:
        raise SGLangError(f"{url}: /generate response lacks {e}: {str(body)[:300]}") from e
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise SGLangError(f"{url}: /generate response has no meta_info.output_token_logprobs "
                          "(the request must set return_logprob)")
    if len(triples) != len(output_ids):
        raise SGLangError(f"{url}: {len(output_ids)} output_ids but {len(triples)} output_token_logprobs")
    if arrays:
        output_ids, logprobs = _token_arrays(output_ids, triples, url)
    else:
        logprobs = []
        for i, (triple, token) in enumerate(zip(triples, output_ids)):
            if int(triple[1]) != token:
                raise SGLangError(f"{url}: output_token_logprobs[{i}] is for token {triple[1]}, output_ids has {token}")
            logprobs.append(float(triple[0]))
    if finish is None:
        raise SGLangError(f"{url}: /generate returned an unfinished (streaming) chunk")
    status = finish.get("status_code") if isinstance(finish, dict) else None
    if isinstance(status, int) and status >= 400:  # an error abort (validation, shutdown), not a client's abort
        kind = SGLangRejected if status < 500 else SGLangUnavailable
        raise kind(f"{url}: /generate aborted with status {status}: {finish.get('message')}")
    reason = finish.get("type") if isinstance(finish, dict) else str(finish)
    if reason not in FINISH_REASONS:
        raise SGLangError(f"{url}: unknown finish_reason {finish!r}")
    version = parse_weight_version(meta.get("weight_version"))
    spans = meta.get("weight_versions")
    return GenerateResult(output_ids, logprobs, reason, version if version is not None else 0,
                          num_retractions=int(meta.get("num_retractions") or 0),
                          cached_tokens=int(meta.get("cached_tokens") or 0),
                          token_versions=None if spans is None else token_versions(spans, len(output_ids), url))


def _id_array(output_ids: Any) -> np.ndarray:
    """SGLang's output_ids as int64 (a TypeError, as `int()` of the list path raises, when they are
    not a list of ids)."""
    try:
        ids = np.array(output_ids, dtype=np.int64)
    except (ValueError, OverflowError) as e:
        raise TypeError(f"output_ids are not token ids ({e})") from e
    if ids.ndim != 1:
        raise TypeError(f"output_ids are not a list of token ids: {str(output_ids)[:100]}")
    return ids


def _token_arrays(output_ids: np.ndarray, triples: list, url: str) -> tuple[TokenArray, TokenArray]:
    """`ids` (output_ids as `_id_array` read them) and the log-probs of SGLang's [logprob, token id,
    text] triples as TokenArrays, each triple's id checked against `ids` (as the list path does,
    with the same message)."""
    ids = output_ids
    if not triples:
        return TokenArray(ids), TokenArray((), np.float32)
    try:
        logprobs = np.fromiter(map(_FIRST, triples), np.float64, count=len(triples))
        triple_ids = np.fromiter(map(_SECOND, triples), np.int64, count=len(triples))
    except (IndexError, KeyError, TypeError) as e:
        raise SGLangError(f"{url}: output_token_logprobs are not [logprob, token_id, text] triples ({e}): "
                          f"{str(triples)[:300]}") from e
    wrong = np.flatnonzero(triple_ids != ids)
    if wrong.size:
        i = int(wrong[0])
        raise SGLangError(f"{url}: output_token_logprobs[{i}] is for token {triples[i][1]}, output_ids has {ids[i]}")
    return TokenArray(ids), TokenArray(logprobs, np.float32)


def token_versions(spans: Any, count: int, url: str = "server") -> tuple[int, ...]:
    """SGLang 0.5.23's meta_info.weight_versions (`[{"version", "start", "end"}]`, contiguous spans
    over the output tokens) as one version per token; a version that is not a number (SGLang's
    startup "default") is 0, as for `weight_version`."""
    versions: list[int] = []
    try:
        for span in spans:
            start, end = int(span["start"]), int(span["end"])
            if start != len(versions) or end < start:
                raise ValueError(f"span [{start}, {end}) does not continue at token {len(versions)}")
            version = parse_weight_version(span["version"])
            versions += [0 if version is None else version] * (end - start)
    except (KeyError, TypeError, ValueError) as e:
        raise SGLangError(f"{url}: /generate meta_info.weight_versions is malformed ({e}): {str(spans)[:300]}") from e
    if len(versions) != count:
        raise SGLangError(f"{url}: meta_info.weight_versions covers {len(versions)} tokens, output_ids has {count}")
    return tuple(versions)


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


class SGLangGenerator(SGLangWeightsMixin):
    """One SGLang(-compatible) server. Use as `async with SGLangGenerator(url) as gen:` or call close().

    The data plane, capacity, abort and health are here; flush, pause/continue and the weight updates
    come from `SGLangWeightsMixin` (`rstar_jax.rollout.sglang_weights`)."""

    def __init__(self, base_url: str, *, retries: int = 3, backoff_s: float = 0.5,
                 request_timeout_s: float | None = None, connect_timeout_s: float = 10.0,
                 generate_timeout_s: float | None = None,
                 max_connections: int = 1024, vocab_size: int | None = None, codec: str = "orjson"):
        if retries < 0:
            raise ValueError(f"SGLangGenerator: retries must be >= 0, got {retries}")
        if codec not in CODECS:
            raise ValueError(f"SGLangGenerator: codec must be one of {CODECS}, got {codec!r}")
        self.codec = codec
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"SGLangGenerator: vocab_size must be >= 1, got {vocab_size}")
        self.base_url = base_url.rstrip("/")
        self.name = f"sglang@{self.base_url}"
        self.retries = retries
        self.backoff_s = backoff_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=connect_timeout_s)
        # One generation that runs longer than this means a hung server (it leaves the rotation).
        self._generate_timeout = (None if generate_timeout_s is None else
                                  aiohttp.ClientTimeout(total=generate_timeout_s, connect=connect_timeout_s))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # /generate (with the orjson codec, to a plain-HTTP server) goes through the lean HTTP/1.1
        # client; everything else through aiohttp's session.
        self._lean, self._lean_prefix = _lean_pool(self.base_url, max_connections) if codec == "orjson" else (None, "")
        self._urls: dict[str, yarl.URL] = {}
        self._version = 0
        self._info: dict | None = None  # /get_server_info, cached: server arguments do not change
        self._no_info = False  # the server has no /get_server_info (a minimal stand-in)
        self._weight_sessions: bool | None = None  # whether it has /begin_weight_update (SGLang 0.5.23)
        self._load_route: str | None = None  # the first of LOAD_ROUTES this server answers
        self._pause_body: bool | None = None  # whether /pause_generation accepts {"mode": ...}
        self._in_place_pauses = 0  # in-place pauses so far: weights may change under a running request
        self._determinism_checked = False
        # The model's vocabulary (embedding rows): given, else what the server or its model's
        # config.json says (see `vocab_limit`). An id at or past it kills a real SGLang server.
        self._vocab_size = vocab_size
        self._vocab_checked = vocab_size is not None
        self.ready = False  # set once /health_generate answered 200

    # -- session / transport ------------------------------------------------------------------
    async def __aenter__(self) -> "SGLangGenerator":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No cookies: SGLang sets none, and filtering a jar costs every request.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_connections),
                cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def _request(self, method: str, path: str, payload: dict | None = None, *,
                       retry: bool = True, idempotent: bool = True, ok_statuses: Sequence[int] = (200,),
                       timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
        """Sends one request with bounded retries; returns (status, parsed JSON or text).

        A non-idempotent request is retried only when it cannot have reached the server (connection
        refused / unreachable, or 503 before admission)."""
        url = self.base_url + path
        target = self._urls.get(path)
        if target is None:  # parsed once per route (yarl's parse is a visible share of a request)
            target = self._urls[path] = yarl.URL(url)
        attempts = 1 + (self.retries if retry else 0)
        last_error, tried = "", 0
        lean = self._lean if path in _LEAN_ROUTES and payload is not None else None
        for attempt in range(attempts):
            tried = attempt + 1
            if self.codec == "json":
                body_args: dict = {"json": payload}
            else:
                body_args = {} if payload is None else {"data": _dumps(payload), "headers": _JSON_HEADERS}
            try:
                if lean is not None:  # the hot path: the lean HTTP/1.1 client (rstar_jax.rollout.http1)
                    limits = timeout or self._timeout
                    status, raw = await lean.request(method, self._lean_prefix + path, body_args["data"],
                                                     timeout=limits.total, connect_timeout=limits.connect)
                else:
                    async with self._get_session().request(method, target, **body_args,
                                                           timeout=timeout or self._timeout) as response:
                        status = response.status
                        if self.codec == "json":
                            text = await response.text()
                        else:
                            raw = await response.read()
                retryable = RETRY_STATUSES if idempotent else (503,)
                if status in retryable and attempt + 1 < attempts:
                    if self.codec != "json":
                        text = raw[:400].decode("utf-8", "replace")
                    last_error = f"HTTP {status}: {text[:200]}"
                else:
                    body = _maybe_json(text) if self.codec == "json" else _loads(raw)
                    if status not in ok_statuses:
                        kind = (SGLangRejected if 400 <= status < 500 else
                                SGLangUnavailable if status >= 500 else SGLangError)
                        raise kind(f"{url}: HTTP {status}: {error_message(body)}")
                    return status, body
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, HttpError) as e:
                last_error = f"{type(e).__name__}: {e}"
                if attempt + 1 >= attempts or not (
                        idempotent or isinstance(e, (aiohttp.ClientConnectorError, HttpConnectError))):
                    break
            delay = self.backoff_s * 2 ** attempt
            log.warning("%s failed (%s); retry %d/%d in %.1fs", url, last_error, attempt + 1, attempts - 1, delay)
            await asyncio.sleep(delay)
        raise SGLangUnavailable(f"{url}: failed after {tried} attempt(s): {last_error}")

    # -- Generator ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The numeric weight_version the server last reported."""
        return self._version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        arrays = self.codec != "json"
        ids = _input_array(input_ids) if arrays else [int(t) for t in input_ids]
        if not len(ids):
            raise ValueError("generate: input_ids must be non-empty")
        vocab = await self.vocab_limit()
        if vocab is not None and not (_ids_within(ids, vocab) if arrays else all(0 <= t < vocab for t in ids)):
            at = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{self.base_url}/generate: input_ids[{at}] = {ids[at]} is outside the model's "
                             f"vocabulary [0, {vocab}) (not sent: SGLang's embedding would fail and take the "
                             f"server down); the tokenizer does not match the model")
        limits = self._limits(await self._facts())
        room = limits.room_for(len(ids))
        if room is not None:
            if room < 1:
                raise ContextLengthExceeded(
                    f"{self.base_url}: a context of {len(ids)} tokens leaves no room for a new token (context "
                    f"length {limits.context_length}, longest input {limits.max_input_tokens})")
            if sampling.max_new_tokens > room:  # SGLang answers 400 to a request past its context length
                sampling = dataclasses.replace(sampling, max_new_tokens=room)
        if sampling.seed is not None and not self._determinism_checked:
            await self._check_determinism()
        payload = {"input_ids": ids, "sampling_params": sampling_payload(sampling), "return_logprob": True,
                   "logprob_start_len": -1, "rid": rid or new_rid(), "stream": False}
        sent_under, in_place_pauses = self._version, self._in_place_pauses
        # Not idempotent: a request the server accepted may already be running, so only failures to
        # connect are retried.
        _, body = await self._request("POST", "/generate", payload, idempotent=False, timeout=self._generate_timeout)
        if isinstance(body, list):
            if len(body) != 1:
                raise SGLangError(f"{self.base_url}/generate: expected one result, got {len(body)}")
            body = body[0]
        result = parse_generate_response(body, url=self.base_url, arrays=arrays)
        if (result.token_versions is None and self._in_place_pauses != in_place_pauses
                and result.weight_version != sent_under):
            # Swapped under it in place, and no per-token spans: the older version for every token.
            result = dataclasses.replace(result, token_versions=(min(sent_under, result.weight_version),)
                                         * len(result.token_ids))
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
        """KV capacity and use summed over the server's DP ranks (each rank has its own pool)."""
        info = await self._cached_info()
        loads = await self.loads()
        rank_total = int(info["max_total_num_tokens"])
        limits = self._limits(info)
        if not loads:  # only /get_server_info: no usage known
            ranks = max(1, int(info.get("dp_size") or 1))
            return dataclasses.replace(limits, total_tokens=rank_total * ranks, ranks=ranks)
        return dataclasses.replace(
            limits,
            total_tokens=sum(int(r.get("max_total_num_tokens") or rank_total) for r in loads),
            used_tokens=sum(int(r.get("num_used_tokens") or 0) for r in loads),
            running_requests=sum(int(r.get("num_running_reqs") or 0) for r in loads),
            queued_requests=sum(int(r.get("num_waiting_reqs") or 0) for r in loads),
            ranks=len(loads))

    @staticmethod
    def _limits(info: dict) -> Capacity:
        """A request's limits from `/get_server_info`: SGLang answers 400 when input + max_new_tokens
        exceeds `context_length` (less the draft slots speculative decoding reserves) and aborts an
        input of `max_req_input_len` tokens or more (min(context, KV pool) - 6)."""
        context = info.get("context_length")
        reserved = 0
        if str(info.get("speculative_algorithm") or "").upper().startswith("EAGLE"):
            reserved = max(int(info.get("speculative_eagle_topk") or 0) * int(info.get("speculative_num_steps") or 0),
                           int(info.get("speculative_num_draft_tokens") or 0))
        max_input = info.get("max_req_input_len")
        return Capacity(total_tokens=int(info.get("max_total_num_tokens") or 0),
                        context_length=None if context is None else int(context) - reserved,
                        max_input_tokens=None if max_input is None else int(max_input) - 1)

    async def vocab_limit(self) -> int | None:
        """The model's vocabulary size, once: the one given, else `vocab_size` in `/get_server_info`
        (`rstar_jax.serve` reports it), else `config.json` in the directory `/model_info` names when
        this machine can read it (local servers, shared storage); None when none says."""
        if not self._vocab_checked:
            self._vocab_checked = True
            info = await self._facts()
            if info.get("vocab_size"):
                self._vocab_size = int(info["vocab_size"])
            else:
                _, model = await self._request("GET", "/model_info", ok_statuses=(200, *ABSENT_STATUSES))
                path = (model if isinstance(model, dict) else {}).get("model_path") or info.get("model_path")
                self._vocab_size = _config_vocab_size(path)
                if self._vocab_size is None:
                    log.info("%s: the model's vocabulary size is unknown (model_path %r is not readable here); "
                             "input ids are not checked against it (pass vocab_size)", self.base_url, path)
        return self._vocab_size

    # -- control plane ------------------------------------------------------------------------
    async def server_info(self) -> dict:
        _, body = await self._request("GET", "/get_server_info")
        if isinstance(body, dict) and ("router_manager" in body or "workers_count" in body):
            raise SGLangError(f"{self.base_url} is an sglang-router, not a server: list its workers as generators "
                              f"instead (the KV scheduler places turns on them itself, and pause, weight updates "
                              f"and loads must reach each worker; the router answers 404 to those)")
        if not isinstance(body, dict) or "max_total_num_tokens" not in body:
            raise SGLangError(f"{self.base_url}/get_server_info: no max_total_num_tokens in {str(body)[:200]}")
        self._info = body
        return body

    async def _cached_info(self) -> dict:
        return self._info if self._info is not None else await self.server_info()

    async def _facts(self) -> dict:
        """`/get_server_info` for checking requests before they are sent; {} from a server without it."""
        if self._info is None and not self._no_info:
            status, body = await self._request("GET", "/get_server_info", ok_statuses=(200, *ABSENT_STATUSES))
            if status == 200 and isinstance(body, dict) and "max_total_num_tokens" in body:
                self._info = body
            else:
                self._no_info = True
        return self._info or {}

    async def loads(self) -> list[dict]:
        """Per-DP-rank load rows, each with at least `dp_rank`, `num_used_tokens`, `num_running_reqs`
        and `num_waiting_reqs` (plus whatever else the server sent). Empty when the server has no
        load route (only /get_server_info). Accepts a bare list or a {"loads": [...]} envelope."""
        routes = LOAD_ROUTES if self._load_route is None else (self._load_route,)
        for route in routes:
            if route == "/get_server_info":
                self._load_route = route
                return []
            status, body = await self._request("GET", route, ok_statuses=(200, *ABSENT_STATUSES))
            if status in ABSENT_STATUSES:
                if self._load_route is not None:
                    raise SGLangError(f"{self.base_url}{route}: answered HTTP {status} after it had worked")
                continue
            if isinstance(body, dict):
                body = body.get("loads", [body])
            if not isinstance(body, list) or not all(isinstance(r, dict) for r in body):
                raise SGLangError(f"{self.base_url}{route}: unexpected response {str(body)[:200]}")
            if self._load_route is None:
                log.info("%s: load route %s", self.base_url, route)
                self._load_route = route
            if route == "/get_load":
                body = [self._from_get_load(r) for r in body]
            return body
        raise AssertionError("unreachable: /get_server_info ends LOAD_ROUTES")

    def _from_get_load(self, row: dict) -> dict:
        """A late-2025 /get_load row in /v1/loads terms. `num_tokens` (KV in use plus queued
        prompt tokens) is the used-token signal; builds counting pages report `num_pages`."""
        if "num_tokens" in row:
            used = int(row["num_tokens"] or 0)
        else:
            used = int(row.get("num_pages") or 0) * int((self._info or {}).get("page_size") or 1)
        return {**row, "num_used_tokens": used, "num_running_reqs": int(row.get("num_reqs") or 0),
                "num_waiting_reqs": int(row.get("num_waiting_reqs") or 0)}

    async def _check_determinism(self) -> None:
        """Warns once per server when seeded sampling meets a server that ignores the seed."""
        self._determinism_checked = True
        try:
            info = await self._cached_info()
        except SGLangError as e:  # the request itself will report an unreachable server
            self._determinism_checked = False
            log.debug("%s: determinism check skipped: %s", self.base_url, e)
            return
        if not info.get("enable_deterministic_inference") and self.base_url not in _warned_nondeterministic:
            _warned_nondeterministic.add(self.base_url)
            log.warning("%s: seeded sampling requested, but /get_server_info shows enable_deterministic_inference "
                        "off; SGLang ignores sampling_seed without --enable-deterministic-inference, so draws "
                        "will not repeat", self.base_url)

    async def health(self) -> bool:
        """True when the server completes a generation (/health_generate answers 200)."""
        ok, _ = await self._probe_health()
        return ok

    async def _probe_health(self) -> tuple[bool, str]:
        try:
            status, body = await self._request("GET", "/health_generate", retry=False, ok_statuses=(200, 503))
        except SGLangError as e:
            return False, str(e)
        if status == 200:
            self.ready = True
        return status == 200, f"HTTP {status}: {error_message(body)}"

    async def wait_ready(self, timeout_s: float = 900.0, interval_s: float = 1.0, max_interval_s: float = 10.0) -> None:
        """Polls /health_generate until it answers 200 (a large model loads for minutes), with the
        interval doubling up to `max_interval_s`; raises SGLangError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline, delay, probes = start + timeout_s, interval_s, 0
        while True:
            probes += 1
            try:
                ok, detail = await asyncio.wait_for(self._probe_health(), max(0.01, deadline - loop.time()))
            except asyncio.TimeoutError:
                ok, detail = False, "probe timed out"
            if ok:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise SGLangError(f"{self.base_url}/health_generate: server not ready after waiting "
                                  f"{loop.time() - start:.1f} s (timeout {timeout_s:g} s, {probes} probes); "
                                  f"last answer: {detail}")
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, max_interval_s)


def _lean_pool(base_url: str, limit: int) -> tuple[Http1Pool | None, str]:
    """The lean client's pool for `base_url` and the path prefix its requests carry; (None, "") for
    a URL it does not serve (https, credentials, a query), which aiohttp then reaches."""
    try:
        url = yarl.URL(base_url)
    except (TypeError, ValueError):
        return None, ""
    if url.scheme != "http" or not url.host or url.user or url.password or url.query_string or url.fragment:
        return None, ""
    return Http1Pool(url.host, url.port or 80, limit=limit), url.raw_path.rstrip("/")


def _config_vocab_size(model_path: Any) -> int | None:
    """`vocab_size` from a Hugging Face directory's config.json, when this machine can read one."""
    try:
        config = json.loads((pathlib.Path(str(model_path)) / "config.json").read_text())
        return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _dumps(payload: Any) -> bytes:
    """A request body: orjson, numpy arrays (input ids) as JSON lists without a Python list between."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _loads(raw: bytes) -> Any:
    """A response body: orjson; the standard library where orjson refuses (NaN / Infinity tokens);
    the text itself when it is not JSON; None when empty."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw.decode("utf-8", "replace")
        return _maybe_json(text)


def _input_array(input_ids: Sequence[int]) -> np.ndarray:
    """The context as a contiguous one-dimensional integer array (a TokenArray's own buffer as is)."""
    ids = np.asarray(input_ids)
    if ids.dtype.kind not in "iu":
        ids = np.asarray([int(t) for t in input_ids] if ids.dtype == object else ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"generate: input_ids must be a sequence of token ids, got shape {ids.shape}")
    return np.ascontiguousarray(ids)


def _ids_within(ids: np.ndarray, vocab: int) -> bool:
    return not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < vocab)


__all__ = ["SGLangError", "SGLangGenerator", "SGLangRejected", "SGLangUnavailable", "parse_generate_response", "sampling_payload"]
