"""SGLang-compatible HTTP server over `JaxEngine` (served by `python -m rstar_jax.serve`).

The surface is SGLang's, with its field names, formats and semantics: token-in `/generate` (no
tokenizer: no `text`, no `stop` strings), `/abort_request` (rid prefix), `/get_server_info`,
`/v1/loads` (`?include=queues` adds the queue section), `/get_load`, `/health`, `/health_generate`,
`/flush_cache`, `/update_weights_from_disk`, `/pause_generation` (modes abort, retract, in_place),
`/continue_generation`, `/get_weight_version`, `/get_model_info` and no-op
`/release_memory_occupation` / `/resume_memory_occupation`. The engine's prefix cache keeps a
finished request's KV for the request that continues it (`meta_info.cached_tokens`, `cache_hit_rate`
in `/v1/loads`); `/flush_cache` drops it, and refuses while requests are in flight, as SGLang does. The
weight_version string starts as "0" and becomes the `weight_version` a weight update names, or
the engine's version counter when it names none. Loading weights from disk is the caller's
(`load_weights(path) -> model`), so this module knows no checkpoint format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time
from collections.abc import Callable

from aiohttp import web

from rstar_jax import __version__ as package_version
from rstar_jax.rollout.engine import PAUSE_MODES, JaxEngine
from rstar_jax.rollout.protocol import SamplingParams
from rstar_jax.rollout.sglang import new_rid

log = logging.getLogger("rstar_jax.serve")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omit it
HEALTH_TIMEOUT_S = 20.0
# Accepted and ignored: they only affect detokenized text, which this token-only server never returns.
TEXT_ONLY_FIELDS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
NEUTRAL_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "n": 1, "stop": None, "regex": None, "json_schema": None, "ebnf": None,
                    "logit_bias": None}


class BadRequest(ValueError):
    """A request field is invalid; answered with HTTP 400 naming the field."""


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}, "object": "error", "message": message,
                              "type": "BadRequest" if status == 400 else "Error", "code": status}, status=status)


def parse_sampling(params: dict | None, eos_token_ids: tuple[int, ...] = ()):
    """SGLang sampling_params -> protocol.SamplingParams (missing fields get SGLang's defaults)."""
    params = dict(params or {})
    for name in TEXT_ONLY_FIELDS:
        params.pop(name, None)
    for name, neutral in NEUTRAL_DEFAULTS.items():
        value = params.pop(name, neutral)
        if value not in (neutral, [], "") and not (name == "n" and value == 1):
            raise BadRequest(f"sampling_params.{name}={value!r} is not supported by this server "
                             f"(token-only engine; use {neutral!r})")
    ignore_eos = bool(params.pop("ignore_eos", False))
    stop_ids = params.pop("stop_token_ids", None) or []
    seed = params.pop("sampling_seed", None)
    try:
        sampling = SamplingParams(
            max_new_tokens=int(params.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            temperature=float(params.pop("temperature", 1.0)),
            top_p=float(params.pop("top_p", 1.0)),
            top_k=int(params.pop("top_k", -1)),
            stop_token_ids=tuple(int(t) for t in stop_ids) + (() if ignore_eos else tuple(eos_token_ids)),
            seed=None if seed is None else int(seed))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params: {e}") from e
    if params:
        raise BadRequest(f"sampling_params: unknown field(s) {sorted(params)}")
    return sampling


def finish_reason_json(result) -> dict:
    """SGLang's meta_info.finish_reason for a GenerateResult."""
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.token_ids[-1]}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.token_ids)}
    return {"type": "abort", "message": "Abort request.", "status_code": None, "err_type": None}


class EngineServer:
    """The aiohttp application over one JaxEngine. load_weights(path) -> model: what
    `/update_weights_from_disk` loads (None: the route answers that this server cannot load weights)."""

    def __init__(self, engine: JaxEngine, *, model_path: str, eos_token_ids: tuple[int, ...] = (),
                 load_weights: Callable[[str], object] | None = None, tp_size: int = 1):
        self.engine = engine
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.load_weights = load_weights
        self.tp_size = tp_size
        self.weight_version = str(engine.version)
        self._update_lock = asyncio.Lock()
        self.started = time.time()
        self.generated_tokens = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        routes = [
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("POST", "/abort_request", self.abort_request),
            ("GET", "/get_server_info", self.server_info), ("GET", "/server_info", self.server_info),
            ("GET", "/get_model_info", self.model_info),
            ("GET", "/v1/loads", self.loads), ("GET", "/get_load", self.get_load),
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health_generate),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/pause_generation", self.pause), ("POST", "/continue_generation", self.resume),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/release_memory_occupation", self.memory_noop), ("POST", "/release_memory_occupation", self.memory_noop),
            ("GET", "/resume_memory_occupation", self.memory_noop), ("POST", "/resume_memory_occupation", self.memory_noop),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    # -- data plane ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error("request body must be JSON")
        try:
            if body.get("stream"):
                raise BadRequest("stream=true is not supported by this server")
            if "text" in body or "input_embeds" in body:
                raise BadRequest("only input_ids is supported (token-only server, no tokenizer)")
            ids = body.get("input_ids")
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            batch = ids if batched else [ids]
            params = body.get("sampling_params")
            params_list = params if isinstance(params, list) else [params] * len(batch)
            rid = body.get("rid")
            if isinstance(rid, list):
                rids = rid
            elif rid is None:
                rids = [None] * len(batch)
            else:
                rids = [rid] if not batched else [f"{rid}_{i}" for i in range(len(batch))]
            if len(params_list) != len(batch) or len(rids) != len(batch):
                raise BadRequest(f"sampling_params / rid lists must have one entry per input ({len(batch)})")
            requests = []
            for i, (row, p, r) in enumerate(zip(batch, params_list, rids)):
                if not isinstance(row, list) or not row or not all(isinstance(t, int) for t in row):
                    raise BadRequest(f"input_ids[{i}] must be a non-empty list of ints" if batched
                                     else "input_ids must be a non-empty list of ints")
                vocab = self.engine.vocab_size
                if any(t < 0 or t >= vocab for t in row):
                    raise BadRequest(f"input_ids{f'[{i}]' if batched else ''} has ids outside [0, {vocab})")
                if len(row) >= self.engine.max_length:
                    raise BadRequest(f"input_ids{f'[{i}]' if batched else ''}: {len(row)} tokens do not fit the "
                                     f"context length {self.engine.max_length}")
                requests.append((row, parse_sampling(p, self.eos_token_ids), r))
        except BadRequest as e:
            return _error(str(e))
        return_logprob = bool(body.get("return_logprob", False))
        outputs = await asyncio.gather(*(self._one(row, s, r, return_logprob) for row, s, r in requests))
        return web.json_response(outputs if batched else outputs[0])

    async def _one(self, ids, sampling, rid, return_logprob: bool) -> dict:
        rid = rid or new_rid()
        start = time.perf_counter()
        result = await self.engine.generate(ids, sampling, rid)
        self.generated_tokens += len(result.token_ids)
        meta = {
            "id": rid,
            "finish_reason": finish_reason_json(result),
            "prompt_tokens": len(ids),
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.cached_tokens,
            "num_retractions": result.num_retractions,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - start,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.token_ids)]
            meta["output_token_logprobs_length"] = len(result.token_ids)
        return {"output_ids": result.token_ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if body.get("abort_all"):
            self.engine.abort_all()
        elif body.get("rid"):
            await self.engine.abort(str(body["rid"]))
        return web.Response(status=200)

    # -- load / info --------------------------------------------------------------------------
    async def _load_row(self) -> dict:
        cap = await self.engine.capacity()
        return {
            "dp_rank": 0,
            "num_running_reqs": cap.running_requests,
            "num_waiting_reqs": cap.queued_requests,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": cap.used_tokens,
            "num_total_tokens": cap.total_tokens,
            "max_total_num_tokens": cap.total_tokens,
            "max_running_requests": self.engine.slots,
            "token_usage": cap.used_tokens / cap.total_tokens,
            "gen_throughput": self.generated_tokens / max(time.time() - self.started, 1e-9),
            "cache_hit_rate": self.engine.cached_tokens / max(self.engine.prompt_tokens, 1),
            "utilization": cap.running_requests / self.engine.slots,
            "queues": {"waiting": cap.queued_requests - cap.retracted_requests, "grammar": 0,
                       "paused": cap.running_requests if self.engine.paused else 0,
                       "retracted": cap.retracted_requests},
        }

    async def loads(self, request: web.Request) -> web.Response:
        row = await self._load_row()
        include = set(request.query.get("include", "core").split(","))
        if not include & {"queues", "all"}:
            row.pop("queues")
        return web.json_response({"loads": [row]})

    async def get_load(self, request: web.Request) -> web.Response:
        row = await self._load_row()
        return web.json_response([{"dp_rank": 0, "num_reqs": row["num_running_reqs"],
                                   "num_waiting_reqs": row["num_waiting_reqs"], "num_tokens": row["num_used_tokens"]}])

    async def server_info(self, request: web.Request) -> web.Response:
        total = self.engine.max_total_tokens
        row = await self._load_row()
        return web.json_response({
            "model_path": self.model_path,
            "context_length": self.engine.max_length,
            "max_running_requests": self.engine.slots,
            "max_total_num_tokens": total,
            "max_req_input_len": self.engine.max_length - 1,
            "page_size": self.engine.page_size,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "skip_tokenizer_init": True,
            "weight_version": self.weight_version,
            "internal_states": [{
                "last_gen_throughput": row["gen_throughput"],
                "memory_usage": {"token_capacity": total},
                "effective_max_running_requests_per_dp": self.engine.slots,
                "load": row["num_running_reqs"] + row["num_waiting_reqs"],
            }],
            "version": f"rstar_jax-{package_version}",
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": self.weight_version})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when a one-token generation completes; 503 while paused or when it does not."""
        if self.engine.paused:
            return web.Response(status=503, text="paused")
        try:
            result = await asyncio.wait_for(
                self.engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0.0)), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            return web.Response(status=503, text=f"generation failed: {e}")
        return web.Response(status=200 if result.finish_reason != "abort" else 503)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.flush_cache():
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.")
        return web.Response(status=200, text="Cache flushed.")

    # -- weights / pause ----------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        path = body.get("model_path")
        if not path or self.load_weights is None:
            message = "model_path is required" if self.load_weights else "this server cannot load weights from disk"
            return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
        async with self._update_lock:
            try:
                model = await asyncio.to_thread(self.load_weights, path)
                version = await asyncio.to_thread(
                    self.engine.update_weights, model,
                    abort_in_flight=bool(body.get("abort_all_requests", False)))
            except (OSError, ValueError) as e:
                return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                          "num_paused_requests": 0}, status=400)
            given = body.get("weight_version")
            self.weight_version = str(given) if given is not None else str(version)
        return web.json_response({"success": True, "message": f"Succeeded to update model weights from {path}.",
                                  "num_paused_requests": 0})

    async def pause(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(f"pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.engine.pause(mode)
        return web.json_response({"message": "Generation paused.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"message": "Generation continued.", "status": "ok"})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def memory_noop(self, request: web.Request) -> web.Response:
        return web.json_response(None)


async def _json_or_empty(request: web.Request) -> dict:
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




async def serve(engine: JaxEngine, *, host: str, port: int, model_path: str, eos_token_ids: tuple[int, ...] = (),
                load_weights: Callable[[str], object] | None = None, tp_size: int = 1,
                port_file: str | None = None) -> None:
    """Serves `engine` until cancelled; writes the bound port to `port_file` once warmed up."""
    server = EngineServer(engine, model_path=model_path, eos_token_ids=eos_token_ids, load_weights=load_weights,
                          tp_size=tp_size)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    # Warm up (compile prefill and decode) before announcing readiness.
    await engine.generate([0], SamplingParams(max_new_tokens=2, temperature=0.0))
    if port_file:
        tmp = pathlib.Path(port_file + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)  # atomic: readers never see a partial file
    log.info("serving %s on http://%s:%d (%d slots, context %d, KV pool %d tokens in pages of %d)", model_path,
             host, bound, engine.slots, engine.max_length, engine.max_total_tokens, engine.page_size)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
