"""SGLang-compatible HTTP server over `JaxEngine` (served by `python -m rstar_jax.serve`).

The surface is SGLang's, with its field names, formats and semantics: `/generate` (token ids, or
`text` and `stop` strings when a tokenizer is loaded; `stream=true` sends cumulative server-sent
events; `logprob_start_len`, `top_logprobs_num` and `return_text_in_logprobs` as SGLang, see
`score_positions`), `/abort_request` (rid prefix), `/health`, `/health_generate` and `/flush_cache`
here; the OpenAI routes `/v1/models`, `/v1/completions` and `/v1/chat/completions`
(`rstar_jax.engine.openai_routes`); `/v1/loads`, `/get_load`, `/get_server_info`, `/get_model_info`
and `/metrics` (`rstar_jax.engine.status_routes`); and the weight updates from disk and from the
trainer's process group, `/get_weights_by_name`, `/pause_generation`, `/continue_generation`,
`/get_weight_version` and the memory-occupation no-ops (`rstar_jax.engine.weight_routes`, which also
says how weight_version moves). The engine's prefix cache keeps a finished request's KV for the
request that continues it (`meta_info.cached_tokens`, `cache_hit_rate` in `/v1/loads`);
`/flush_cache` drops it, and refuses while requests are in flight, as SGLang does.

Serving follows SGLang's life cycle: the port is bound before warm-up (compilation), and `/health`
and `/health_generate` answer 503 until it is done (`ready`). A client that disconnects from a
generation route (`/generate`, the OpenAI routes) aborts its requests at the next engine step;
other routes (weight updates, pause, flush) finish what they started even if their client leaves.
`sampling_seed` (OpenAI `seed`) is honoured only with `deterministic` (SGLang ignores it without
`--enable-deterministic-inference`). With a tokenizer, generation also stops on its EOS token, as
SGLang's does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable

import numpy as np
from aiohttp import web

from rstar_jax.engine.http_common import (BadRequest, dumps, error_response, json_floats, json_or_empty,
                                          json_response, request_json)
from rstar_jax.engine.jax_engine import MAX_STOP_IDS, JaxEngine
from rstar_jax.engine.openai_routes import OpenAIRoutes
from rstar_jax.engine.status_routes import StatusRoutes
from rstar_jax.engine.weight_routes import WeightRoutes
from rstar_jax.rollout.protocol import FINISH_STOP, SamplingParams, new_rid
from rstar_jax.engine.textgen import JinjaChatTemplate, TextDecoder, TextRequest, output_text, token_texts

log = logging.getLogger("rstar_jax.serve")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omit it
HEALTH_TIMEOUT_S = 20.0
# Accepted and ignored: spacing between special tokens in text, and the stream's chunk cadence.
TEXT_ONLY_FIELDS = {"spaces_between_special_tokens", "stream_interval"}
NEUTRAL_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "n": 1, "regex": None, "json_schema": None, "ebnf": None,
                    "logit_bias": None}
# /generate's top-level fields: honoured; accepted only at SGLang's defaults (another value asks for
# something this server cannot do: 400 naming it); accepted without effect (routing, caching and
# logging hints). Any other field is refused.
GENERATE_FIELDS = {"text", "input_ids", "rid", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream"}
GENERATE_AT_DEFAULT: dict[str, tuple] = {
    # sglang-router fills these in every request it forwards (background and return_bytes are its own
    # and SGLang's response options; this server answers in the foreground, as JSON).
    "background": (None, False), "return_bytes": (None, False),
    "input_embeds": (None,), "image_data": (None,), "video_data": (None,), "audio_data": (None,),
    "lora_path": (None,), "lora_id": (None,), "token_ids_logprob": (None,), "custom_logit_processor": (None,),
    "session_params": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
    "return_hidden_states": (None, False), "return_routed_experts": (None, False), "return_entropy": (None, False),
    "return_prompt_token_ids": (None, False), "return_sampling_mask": (None, False),
    "routed_dp_rank": (None, 0), "data_parallel_rank": (None, 0),
}
GENERATE_IGNORED = {"session_id", "priority", "extra_key", "cache_salt", "log_metrics", "custom_labels",
                    "routed_experts_start_len", "no_logs", "routing_key", "conversation_id"}
# Routes whose handler is cancelled when the client disconnects (its requests are aborted); every
# other route runs to the end regardless, so that e.g. a weight update is never left half done.
CANCEL_ON_DISCONNECT = {"/generate", "/v1/completions", "/v1/chat/completions", "/health_generate"}


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """The sampling_params that shape the output text (they need a tokenizer, except the defaults)."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


def parse_sampling(params: dict | None, eos_token_ids: tuple[int, ...] = (), *,
                   honour_seed: bool = True) -> tuple[SamplingParams, TextOptions]:
    """SGLang sampling_params -> (protocol.SamplingParams, TextOptions); missing fields get SGLang's
    defaults. `honour_seed` False drops `sampling_seed`, as SGLang does without deterministic inference."""
    params = dict(params or {})
    for name in TEXT_ONLY_FIELDS:
        params.pop(name, None)
    stop = params.pop("stop", None)
    stop = (stop,) if isinstance(stop, str) else stop
    if not (stop is None or isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
    text = TextOptions(stop=tuple(s for s in stop or () if s),
                       skip_special_tokens=params.pop("skip_special_tokens", True) is not False,
                       no_stop_trim=bool(params.pop("no_stop_trim", False)))
    for name, neutral in NEUTRAL_DEFAULTS.items():
        value = params.pop(name, neutral)
        if value not in (neutral, [], "") and not (name == "n" and value == 1):
            raise BadRequest(f"sampling_params.{name}={value!r} is not supported by this server "
                             f"(use {neutral!r})")
    ignore_eos = bool(params.pop("ignore_eos", False))
    stop_ids = params.pop("stop_token_ids", None) or []
    seed = params.pop("sampling_seed", None)
    try:
        stop_token_ids = tuple(dict.fromkeys([*(int(t) for t in stop_ids), *(() if ignore_eos else eos_token_ids)]))
        sampling = SamplingParams(
            max_new_tokens=int(params.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            temperature=float(params.pop("temperature", 1.0)),
            top_p=float(params.pop("top_p", 1.0)),
            top_k=int(params.pop("top_k", -1)),
            stop_token_ids=stop_token_ids,
            seed=None if seed is None or not honour_seed else int(seed))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params: {e}") from e
    if params:
        raise BadRequest(f"sampling_params: unknown field(s) {sorted(params)}")
    if len(sampling.stop_token_ids) > MAX_STOP_IDS:
        raise BadRequest(f"sampling_params.stop_token_ids: at most {MAX_STOP_IDS} stop ids, the model's eos "
                         f"included, got {len(sampling.stop_token_ids)}")
    return sampling, text


def finish_reason_json(result) -> dict:
    """SGLang's meta_info.finish_reason for a GenerateResult."""
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.token_ids[-1]}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.token_ids)}
    return {"type": "abort", "message": "Abort request.", "status_code": None, "err_type": None}



class EngineServer:
    """The aiohttp application over one JaxEngine: the generation, abort, health and cache routes,
    composing the OpenAI (`OpenAIRoutes`), status (`StatusRoutes`: loads, info, metrics) and weight
    (`WeightRoutes`) routes. load_weights(path) -> model: what `/update_weights_from_disk` loads
    (None: the route answers that this server cannot load weights); load_tensors and read_tensor:
    the distributed update's and `/get_weights_by_name`'s (see `rstar_jax.engine.weight_routes`).

    tokenizer (an `rstar_jax.agent.tokenizer` tokenizer) enables text in and out, stop strings and the
    OpenAI routes (None: SGLang's --skip-tokenizer-init); chat_template renders chat messages.
    served_model_name: the model's name in /v1/models and metric labels (default: model_path).
    deterministic: honour `sampling_seed` (SGLang's --enable-deterministic-inference).
    enable_metrics: serve /metrics. server_args: the command's settings, reported by /get_server_info
    (SGLang reports every ServerArgs field). ready: warm-up is done (/health answers 503 until then).
    """

    def __init__(self, engine: JaxEngine, *, model_path: str, eos_token_ids: tuple[int, ...] = (),
                 load_weights: Callable[[str], object] | None = None, tp_size: int = 1,
                 load_tensors: Callable[[object, dict], object] | None = None,
                 read_tensor: Callable[[object, str], np.ndarray] | None = None,
                 tokenizer=None, tokenizer_path: str | None = None, chat_template: JinjaChatTemplate | None = None,
                 served_model_name: str | None = None, deterministic: bool = False, enable_metrics: bool = False,
                 server_args: dict | None = None, ready: bool = False):
        self.engine = engine
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path if tokenizer is not None else None
        self.chat_template = chat_template
        self.served_model_name = served_model_name or model_path
        self.deterministic = deterministic
        self.enable_metrics = enable_metrics
        self.server_args = dict(server_args or {})
        self.ready = ready
        # The ids generation stops on: the model's eos, and with a tokenizer its eos too (as SGLang).
        self.stop_token_ids = tuple(dict.fromkeys([*eos_token_ids, *([tokenizer.eos_id] if tokenizer else [])]))
        self.tp_size = tp_size
        self.status = StatusRoutes(self)
        self.weights = WeightRoutes(engine, load_weights=load_weights, load_tensors=load_tensors,
                                    read_tensor=read_tensor)
        self.started = time.time()

    @property
    def weight_version(self) -> str:
        """The version of the weights served, as the last weight update set it."""
        return self.weights.weight_version

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        routes = [
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("POST", "/abort_request", self.abort_request),
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health_generate),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
        ]
        routes += self.status.routes(metrics=self.enable_metrics)
        routes += self.weights.routes()
        routes += OpenAIRoutes(self).routes()
        for method, path, handler in routes:
            if path not in CANCEL_ON_DISCONNECT:  # a control call finishes even if its client leaves
                handler = _shielded(handler)
            app.router.add_route(method, path, handler)
        return app

    # -- data plane ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request_json(request)
        except ValueError:
            return error_response("request body must be JSON")
        try:
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            requests, batched, options = self._parse_generate(body)
        except BadRequest as e:
            return error_response(str(e))
        if options.stream:
            return await self._stream_generate(request, *requests[0], options)
        outputs = await asyncio.gather(*(self._one(*r, options) for r in requests))
        # Every float that may be non-finite (the log-probs) went through json_floats (_triples).
        return json_response(outputs if batched else outputs[0], floats_checked=True)

    def _parse_generate(self, body: dict) -> tuple[list[tuple], bool, "_LogprobOptions"]:
        """[(input ids, SamplingParams, TextOptions, rid)], whether it is a batch, and the options."""
        for name, accepted in GENERATE_AT_DEFAULT.items():
            if name in body and body[name] not in accepted:
                raise BadRequest(f"{name}={body[name]!r} is not supported by this server")
        model = body.get("model")  # a router's routing field: null, or the model this server serves
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise BadRequest(f"model={model!r}: this server serves {self.served_model_name!r}")
        unknown = sorted(set(body) - GENERATE_FIELDS - {"model"} - set(GENERATE_AT_DEFAULT) - GENERATE_IGNORED)
        if unknown:
            raise BadRequest(f"unknown field(s) {unknown}")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("exactly one of text and input_ids is required")
        if text is not None:
            if self.tokenizer is None:
                raise BadRequest("text needs a tokenizer, and this server runs without one (--skip-tokenizer-init, "
                                 "or a preset model): send input_ids")
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise BadRequest("text must be a non-empty string or a non-empty list of them")
            encoded = [self.tokenizer.encode(t) for t in texts]
            ids, field = (encoded if batched else encoded[0]), "text"
        else:
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            field = "input_ids"
        options = _LogprobOptions.parse(body, self)
        if options.stream and batched:
            raise BadRequest("stream=true takes one input, not a batch")
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
            where = f"{field}[{i}]" if batched else field
            if not isinstance(row, list) or not row or not _all_ints(row):
                raise BadRequest(f"{where} must be a non-empty list of ints")
            vocab = self.engine.vocab_size
            if not _ids_within(row, vocab):
                raise BadRequest(f"{where} has ids outside [0, {vocab})")
            if len(row) >= self.engine.max_length:
                raise BadRequest(f"{where}: {len(row)} tokens do not fit the context length {self.engine.max_length}")
            if options.return_logprob and options.start_len >= len(row):
                raise BadRequest(f"logprob_start_len ({options.start_len}) must be below the {len(row)} prompt "
                                 f"tokens of {where}")
            sampling, text_options = parse_sampling(p, self.stop_token_ids, honour_seed=self.deterministic)
            if isinstance(p, dict) and "max_new_tokens" in p and len(row) + sampling.max_new_tokens > self.engine.max_length:
                # SGLang's check and words: an explicit max_new_tokens past the context is refused, not cut.
                raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                                 f"{self.engine.max_length} tokens. You requested a total of "
                                 f"{len(row) + sampling.max_new_tokens} tokens: {len(row)} tokens from the input "
                                 f"and {sampling.max_new_tokens} tokens for the completion ({where})")
            if text_options.stop and self.tokenizer is None:
                raise BadRequest("sampling_params.stop needs a tokenizer, and this server runs without one "
                                 "(--skip-tokenizer-init, or a preset model): use stop_token_ids")
            requests.append((row, sampling, text_options, r))
        return requests, batched, options

    def _decoder(self, sampling: SamplingParams, text: TextOptions) -> TextDecoder | None:
        if self.tokenizer is None:
            return None
        return TextDecoder(self.tokenizer, stop=text.stop, stop_token_ids=sampling.stop_token_ids,
                           skip_special_tokens=text.skip_special_tokens, no_stop_trim=text.no_stop_trim)

    async def _one(self, ids, sampling: SamplingParams, text: TextOptions, rid, options: "_LogprobOptions") -> dict:
        rid = rid or new_rid()
        start = time.perf_counter()
        matched = output = None
        if text.stop:  # watched token by token; the request ends once a stop string appears
            request = TextRequest(self.engine, ids, sampling, rid, self._decoder(sampling, text))
            try:
                outcome = await request.finish()
            finally:
                request.close()
            result, output, matched = outcome.result, outcome.text, outcome.matched_stop
        else:
            result = await self.engine.generate(ids, sampling, rid)
            if self.tokenizer is not None:
                output = output_text(self.tokenizer, result.token_ids,
                                     trim_stop_token=result.finish_reason == FINISH_STOP and not text.no_stop_trim,
                                     skip_special_tokens=text.skip_special_tokens)
        self.record_request(len(ids), result, start)
        return await self._response(ids, result, output, matched, rid, start, sampling, options)

    async def _response(self, ids, result, text: str | None, matched: str | None, rid: str, start: float,
                        sampling: SamplingParams, options: "_LogprobOptions") -> dict:
        finish = {"type": "stop", "matched": matched} if matched is not None else finish_reason_json(result)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.cached_tokens,
            "num_retractions": result.num_retractions,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - start,
        }
        spans = self._version_spans(result.token_versions)
        if len(spans) > 1:  # an in-place weight update crossed the request: SGLang 0.5.23's spans
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if options.return_logprob:
            meta["output_token_logprobs"] = self._triples(result.logprobs, result.token_ids, options.with_text)
            meta["output_token_logprobs_length"] = len(result.token_ids)
            if options.start_len >= 0 or options.top_n:
                scores = await self.score_positions(ids, result.token_ids, sampling, start_len=options.start_len,
                                                    top_n=options.top_n)
                if options.start_len >= 0:
                    meta["input_token_logprobs"] = self._triples(*zip(*scores["input"]), options.with_text)
                    if options.top_n:
                        meta["input_top_logprobs"] = [None if row is None else self._triples(*zip(*row),
                                                                                          options.with_text)
                                                      for row in scores["input_top"]]
                if options.top_n:
                    meta["output_top_logprobs"] = [self._triples(*zip(*row), options.with_text)
                                                   for row in scores["output_top"]]
        out = {} if text is None else {"text": text}
        return {**out, "output_ids": result.token_ids, "meta_info": meta}

    def _version_spans(self, token_versions) -> list[dict]:
        """SGLang's meta_info.weight_versions: [{"version", "start", "end"}] over the output tokens,
        one span per run of tokens one weight version sampled."""
        spans: list[dict] = []
        for i, version in enumerate(token_versions or ()):
            name = self.weights.version_name(version)
            if spans and spans[-1]["version"] == name:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": name, "start": i, "end": i + 1})
        return spans

    def _triples(self, logprobs, ids, with_text: bool) -> list[list]:
        """SGLang's [logprob, token id, text or None] triples (log-probs through `json_floats`: a
        non-finite one is written as the standard library wrote it)."""
        texts = token_texts(self.tokenizer, ids) if with_text else [None] * len(ids)
        return [[lp, int(t), s] for lp, t, s in zip(json_floats(logprobs), ids, texts)]

    async def score_positions(self, prompt: list[int], output: list[int], sampling: SamplingParams, *,
                              start_len: int, top_n: int) -> dict:
        """SGLang's extra log-probs of one finished request, from `JaxEngine.score` (a forward over
        prompt + output after the fact: the same weights unless a weight update came in between):

        - "input": [(logprob, id)] for prompt positions start_len.. (start_len >= 0, else []); the first
          logprob is None, as SGLang's (it reports position k from the hidden state at k);
        - "input_top": per those positions None (the first) or the top_n [(logprob, id)] (top_n > 0);
        - "output_top": per output token the top_n [(logprob, id)] of the distribution it was drawn from.

        Prompt positions are at temperature 1; output ones at the request's temperature (1 when
        greedy), matching the sampled tokens' log-probs.
        """
        prompt_len, sequence = len(prompt), [*prompt, *output]
        result = {"input": [], "input_top": [], "output_top": []}
        if start_len >= 0:
            result["input"].append((None, prompt[start_len]))
            if top_n:
                result["input_top"].append(None)
        first = start_len + 1 if start_len >= 0 else prompt_len  # scored positions: [first, last)
        last = len(sequence) if top_n else prompt_len
        if last <= first:
            return result
        sampled = 1.0 if sampling.greedy or self.engine.original_logprobs else sampling.temperature
        temperatures = [1.0 if t < prompt_len else sampled for t in range(first, last)]
        logprobs, top_values, top_ids = await asyncio.to_thread(self.engine.score, sequence[:last], start=first,
                                                                top_k=top_n, temperature=temperatures)
        for row, t in enumerate(range(first, last)):
            top = list(zip(top_values[row].tolist(), top_ids[row].tolist()))
            if t < prompt_len:
                result["input"].append((float(logprobs[row]), prompt[t]))
                if top_n:
                    result["input_top"].append(top)
            else:
                result["output_top"].append(top)
        return result

    async def _stream_generate(self, request: web.Request, ids, sampling: SamplingParams, text: TextOptions, rid,
                               options: "_LogprobOptions") -> web.StreamResponse:
        """stream=true: server-sent events with the output so far (cumulative, SGLang's default) and
        a null finish_reason, then the whole response, then [DONE]."""
        rid = rid or new_rid()
        start = time.perf_counter()
        decoder = self._decoder(sampling, text)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        generation = TextRequest(self.engine, ids, sampling, rid, decoder)
        so_far = ""
        try:
            async for _ in generation.updates():
                meta = {"id": rid, "finish_reason": None, "prompt_tokens": len(ids),
                        "completion_tokens": len(generation.tokens), "weight_version": self.weight_version}
                if options.return_logprob:
                    meta["output_token_logprobs"] = self._triples(generation.logprobs, generation.tokens,
                                                                  options.with_text)
                chunk = {"output_ids": list(generation.tokens), "meta_info": meta}
                if decoder is not None:
                    so_far += decoder.delta()
                    chunk = {"text": so_far, **chunk}
                await response.write(_sse(chunk))
            outcome = await generation.finish()
            self.record_request(len(ids), outcome.result, start)
            final = await self._response(ids, outcome.result, outcome.text, outcome.matched_stop, rid, start,
                                         sampling, options)
            await response.write(_sse(final))
            await response.write(_sse("[DONE]"))
        except ConnectionResetError:  # the client left; closing the generation aborts it
            return response
        finally:
            generation.close()
        await response.write_eof()
        return response

    def record_request(self, prompt_tokens: int, result, start: float) -> None:
        """Counts one finished request for /metrics."""
        self.status.record_request(prompt_tokens, result, start)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_or_empty(request)
        if body.get("abort_all"):
            self.engine.abort_all()
        elif body.get("rid"):
            await self.engine.abort(str(body["rid"]))
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        """503 until warm-up is done (SGLang's ServerStatus.Starting), then 200."""
        return web.Response(status=200) if self.ready else web.Response(status=503, text="starting")

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when a one-token generation completes; 503 while starting, paused or when it does not."""
        if not self.ready:
            return web.Response(status=503, text="starting")
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


def _int_array(row: list) -> np.ndarray | None:
    """`row` as an int64 array when every entry is a Python int (bools count, as isinstance says),
    else None; one numpy pass instead of a Python one over a context's ids."""
    try:
        array = np.asarray(row)
    except (OverflowError, ValueError):
        return None
    return array if array.ndim == 1 and array.dtype.kind in "ib" else None


def _all_ints(row: list) -> bool:
    array = _int_array(row)
    if array is not None:
        return True
    return all(isinstance(t, int) for t in row)  # ids past int64, or a mixed row: the exact check


def _ids_within(row: list, vocab: int) -> bool:
    array = _int_array(row)
    if array is not None:
        return bool(array.min() >= 0 and array.max() < vocab)
    return not any(t < 0 or t >= vocab for t in row)


def _shielded(handler):
    """The handler run to its end even when aiohttp cancels it because the client went away."""
    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))
    return run


def _sse(payload) -> bytes:
    """One server-sent event of /generate's stream (its log-probs came through `_triples`)."""
    data = payload.encode() if isinstance(payload, str) else dumps(payload, floats_checked=True)
    return b"data: " + data + b"\n\n"


@dataclasses.dataclass(frozen=True)
class _LogprobOptions:
    """/generate's per-call output options."""

    return_logprob: bool = False
    start_len: int = -1  # logprob_start_len
    top_n: int = 0  # top_logprobs_num
    with_text: bool = False  # return_text_in_logprobs
    stream: bool = False

    @classmethod
    def parse(cls, body: dict, server: EngineServer) -> "_LogprobOptions":
        start_len, top_n = body.get("logprob_start_len", -1), body.get("top_logprobs_num", 0)
        start_len = -1 if start_len is None else start_len
        top_n = 0 if top_n is None else top_n
        if not isinstance(start_len, int) or isinstance(start_len, bool) or start_len < -1:
            raise BadRequest(f"logprob_start_len must be an integer >= -1, got {start_len!r}")
        vocab = server.engine.vocab_size
        if not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= vocab:
            raise BadRequest(f"top_logprobs_num must be an integer in [0, {vocab}], got {top_n!r}")
        with_text = bool(body.get("return_text_in_logprobs", False))
        if with_text and server.tokenizer is None:
            raise BadRequest("return_text_in_logprobs needs a tokenizer, and this server runs without one "
                             "(--skip-tokenizer-init, or a preset model)")
        return cls(bool(body.get("return_logprob", False)), start_len, top_n, with_text, bool(body.get("stream")))


async def serve(engine: JaxEngine, *, host: str, port: int, port_file: str | None = None, **options) -> None:
    """Serves `engine` (`options`: EngineServer's) until cancelled. As SGLang, the port is bound first
    (and written to `port_file`, atomically), then the engine warms up (compiles prefill and decode)
    while /health and /health_generate answer 503."""
    server = EngineServer(engine, **options)
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    server.server_args["port"] = bound  # the port chosen for --port 0
    if port_file:
        tmp = pathlib.Path(port_file + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)  # atomic: readers never see a partial file
    log.info("listening on http://%s:%d; warming up", host, bound)
    try:
        await engine.generate([0], SamplingParams(max_new_tokens=2, temperature=0.0))
        server.ready = True
        log.info("serving %s on http://%s:%d (%d slots, context %d, KV pool %d tokens in pages of %d%s)",
                 server.served_model_name, host, bound, engine.slots, engine.max_length, engine.max_total_tokens,
                 engine.page_size, "" if server.tokenizer is not None else ", no tokenizer")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
