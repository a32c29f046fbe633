"""SGLang-compatible HTTP server over `JaxEngine` (served by `python -m rstar_jax.serve`).

The surface is SGLang's, with its field names, formats and semantics: `/generate` (token ids, or
`text` and `stop` strings when a tokenizer is loaded; `stream=true` sends cumulative server-sent
events; `logprob_start_len`, `top_logprobs_num` and `return_text_in_logprobs` as SGLang, see
`score_positions`), the OpenAI routes `/v1/models`, `/v1/completions` and `/v1/chat/completions`
(`rstar_jax.engine.openai_routes`), `/metrics` (Prometheus text with SGLang's names, with
`enable_metrics`), `/abort_request` (rid prefix), `/get_server_info`,
`/v1/loads` (`?include=queues` adds the queue section), `/get_load`, `/health`, `/health_generate`,
`/flush_cache`, `/update_weights_from_disk`, the distributed weight update (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`), `/get_weights_by_name`,
`/pause_generation` (modes abort, retract, in_place), `/continue_generation`, `/get_weight_version`,
`/get_model_info` and no-op
`/release_memory_occupation` / `/resume_memory_occupation`. The engine's prefix cache keeps a
finished request's KV for the request that continues it (`meta_info.cached_tokens`, `cache_hit_rate`
in `/v1/loads`); `/flush_cache` drops it, and refuses while requests are in flight, as SGLang does. The
weight_version string starts as "0" and becomes the `weight_version` a weight update names, or
the engine's version counter when it names none. Loading weights from disk is the caller's
(`load_weights(path) -> model`), and so are applying tensors received by name
(`load_tensors(model, {name: array}) -> model`) and reading one back (`read_tensor(model, name)`), so
this module knows no checkpoint format. The distributed update joins the trainer's torch.distributed
group as one rank whatever the tensor-parallel size (one process holds every device), receives each
broadcast tensor (on the host with gloo; on the GPU with nccl, handed to JAX through DLPack) and
applies the call's tensors in one swap (`/get_server_info` reports the rank count as
`weight_update_ranks`; SGLang's servers join with one rank per GPU).

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
import collections
import dataclasses
import json
import logging
import pathlib
import time
from collections.abc import Callable

import numpy as np
from aiohttp import web

from rstar_jax import __version__ as package_version
from rstar_jax.engine import weight_transfer
from rstar_jax.engine.jax_engine import MAX_STOP_IDS, PAUSE_MODES, JaxEngine
from rstar_jax.engine.openai_routes import OpenAIRoutes
from rstar_jax.engine.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rstar_jax.engine.prometheus import Exposition, Histogram
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
# SGLang's bucket bounds (seconds) for its latency histograms.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)
THROUGHPUT_WINDOW_S = 10.0  # gen_throughput: tokens per second over at least this long


class BadRequest(ValueError):
    """A request field is invalid; answered with HTTP 400 naming the field."""


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}, "object": "error", "message": message,
                              "type": "BadRequest" if status == 400 else "Error", "code": status}, status=status)


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
    """The aiohttp application over one JaxEngine. load_weights(path) -> model: what
    `/update_weights_from_disk` loads (None: the route answers that this server cannot load weights).

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
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e_latency = Histogram(E2E_BUCKETS)
        engine.on_first_token = self.ttft.observe
        self._throughput_samples = collections.deque([(time.monotonic(), engine.generated_tokens)])
        self.load_weights = load_weights
        self.load_tensors = load_tensors
        self.read_tensor = read_tensor
        self._groups: dict[str, weight_transfer.WeightUpdateGroup] = {}  # weight-update groups by name
        self._weight_session = False  # SGLang 0.5.23's begin/end_weight_update bracket is open
        self.tp_size = tp_size
        self.weight_version = str(engine.version)
        self._update_lock = asyncio.Lock()
        self.started = time.time()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        routes = [
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("POST", "/abort_request", self.abort_request),
            ("GET", "/get_server_info", self.server_info), ("GET", "/server_info", self.server_info),
            ("GET", "/get_model_info", self.model_info), ("GET", "/model_info", self.model_info),
            ("GET", "/v1/loads", self.loads), ("GET", "/get_load", self.get_load),
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health_generate),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/begin_weight_update", self.begin_weight_update),
            ("POST", "/end_weight_update", self.end_weight_update),
            ("GET", "/get_weights_by_name", self.get_weights_by_name),
            ("POST", "/get_weights_by_name", self.get_weights_by_name),
            ("POST", "/pause_generation", self.pause), ("POST", "/continue_generation", self.resume),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/release_memory_occupation", self.memory_noop), ("POST", "/release_memory_occupation", self.memory_noop),
            ("GET", "/resume_memory_occupation", self.memory_noop), ("POST", "/resume_memory_occupation", self.memory_noop),
        ]
        routes += OpenAIRoutes(self).routes()
        if self.enable_metrics:
            routes.append(("GET", "/metrics", self.metrics))
        for method, path, handler in routes:
            if path not in CANCEL_ON_DISCONNECT:  # a control call finishes even if its client leaves
                handler = _shielded(handler)
            app.router.add_route(method, path, handler)
        return app

    # -- data plane ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error("request body must be JSON")
        try:
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            requests, batched, options = self._parse_generate(body)
        except BadRequest as e:
            return _error(str(e))
        if options.stream:
            return await self._stream_generate(request, *requests[0], options)
        outputs = await asyncio.gather(*(self._one(*r, options) for r in requests))
        return web.json_response(outputs if batched else outputs[0])

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
            if not isinstance(row, list) or not row or not all(isinstance(t, int) for t in row):
                raise BadRequest(f"{where} must be a non-empty list of ints")
            vocab = self.engine.vocab_size
            if any(t < 0 or t >= vocab for t in row):
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

    def _triples(self, logprobs, ids, with_text: bool) -> list[list]:
        """SGLang's [logprob, token id, text or None] triples."""
        texts = token_texts(self.tokenizer, ids) if with_text else [None] * len(ids)
        return [[lp, int(t), s] for lp, t, s in zip(logprobs, ids, texts)]

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
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += len(result.token_ids)
        self.e2e_latency.observe(time.perf_counter() - start)

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
            "gen_throughput": self._throughput(),
            "cache_hit_rate": self.engine.cached_tokens / max(self.engine.prompt_tokens, 1),
            "utilization": cap.running_requests / self.engine.slots,
            "queues": {"waiting": cap.queued_requests - cap.retracted_requests, "grammar": 0,
                       "paused": cap.running_requests if self.engine.paused else 0,
                       "retracted": cap.retracted_requests},
        }

    def _throughput(self) -> float:
        """Tokens per second over the last THROUGHPUT_WINDOW_S or more (since the previous query
        when queries are further apart), as SGLang's gen_throughput covers its last log interval."""
        now, total = time.monotonic(), self.engine.generated_tokens
        samples = self._throughput_samples
        if now - samples[-1][0] >= 0.5:  # a bounded history however often this is asked
            samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
            samples.popleft()
        then, before = samples[0]
        return (total - before) / (now - then) if now > then else 0.0

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text with SGLang's metric names, labelled with the served model name."""
        row = await self._load_row()
        e = Exposition({"model_name": self.served_model_name})
        e.gauge("sglang:num_running_reqs", row["num_running_reqs"], "The number of running requests.")
        e.gauge("sglang:num_queue_reqs", row["num_waiting_reqs"], "The number of requests in the waiting queue.")
        e.gauge("sglang:num_used_tokens", row["num_used_tokens"], "The number of used tokens.")
        e.gauge("sglang:max_total_num_tokens", row["max_total_num_tokens"], "The KV cache pool size in tokens.")
        e.gauge("sglang:token_usage", row["token_usage"], "The token usage.")
        e.gauge("sglang:cache_hit_rate", row["cache_hit_rate"], "The prefix cache hit rate.")
        e.gauge("sglang:gen_throughput", row["gen_throughput"], "The generation throughput (token/s).")
        e.counter("sglang:prompt_tokens_total", self.prompt_tokens_total, "Number of prefill tokens processed.")
        e.counter("sglang:generation_tokens_total", self.generation_tokens_total,
                  "Number of generation tokens processed.")
        e.counter("sglang:num_requests_total", self.requests_total, "Number of requests processed.")
        e.histogram("sglang:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds.")
        e.histogram("sglang:e2e_request_latency_seconds", self.e2e_latency,
                    "Histogram of End-to-end request latency in seconds")
        return web.Response(body=e.text().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

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
            **self.server_args,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "enable_deterministic_inference": self.deterministic,
            "enable_metrics": self.enable_metrics,
            "context_length": self.engine.max_length,
            "max_running_requests": self.engine.slots,
            "max_total_num_tokens": total,
            "max_req_input_len": self.engine.max_length,  # SGLang's meaning: inputs shorter than this
            "vocab_size": self.engine.vocab_size,  # rstar_jax: SGLang's clients cannot learn it otherwise
            "page_size": self.engine.page_size,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "weight_update_ranks": 1,  # rstar_jax: ranks it joins a weight-update group with (SGLang: tp_size)
            "skip_tokenizer_init": self.tokenizer is None,
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
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.weight_version})

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

    # -- distributed weight update (SGLang's /init_weights_update_group family) ------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Joins the trainer's group as rank `rank_offset`; answers once every rank has joined."""
        body = await _json_or_empty(request)
        try:
            address, port = str(body["master_address"]), _int(body, "master_port")
            rank, world_size = _int(body, "rank_offset"), _int(body, "world_size")
        except (KeyError, BadRequest) as e:
            return _weights_error(f"init_weights_update_group: {e if isinstance(e, BadRequest) else f'missing {e}'}")
        group_name = str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME))
        backend = str(body.get("backend", "nccl"))
        if self.load_tensors is None:
            return _weights_error("this server cannot load weights from tensors")
        if group_name in self._groups:
            return _weights_error(f"Failed to initialize custom process group: group {group_name!r} already exists "
                                  f"(destroy it first).")
        try:
            group = await asyncio.to_thread(weight_transfer.WeightUpdateGroup.connect, address, port, rank, world_size,
                                            group_name=group_name, backend=backend)
        except Exception as e:  # noqa: BLE001  (torch missing, bad backend, rendezvous timeout: all answered)
            return _weights_error(f"Failed to initialize custom process group: {e}.")
        self._groups[group_name] = group
        log.info("joined weight-update group %r as rank %d of %d (%s, %s:%d)", group_name, rank, world_size, backend,
                 address, port)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receives the listed tensors (HF names) from rank 0's broadcasts, in order, then applies
        them in one swap: running requests finish on the old weights first unless
        `abort_all_requests`; the prefix cache is dropped (its KV came from the old weights)."""
        body = await _json_or_empty(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME))
        group = self._groups.get(group_name)
        problem = None
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            problem = "names, dtypes and shapes must be lists of equal length"
        elif bad := [d for d in dtypes if d not in weight_transfer.DTYPES]:
            problem = f"dtypes: {bad[0]!r} is not one of {weight_transfer.DTYPES}"
        elif not all(isinstance(s, list) and all(isinstance(n, int) and n >= 0 for n in s) for s in shapes):
            problem = "shapes must be lists of non-negative ints"
        elif group is None:
            problem = f"group {group_name!r} does not exist: call /init_weights_update_group first"
        elif body.get("load_format") is not None:
            problem = f"load_format {body['load_format']!r} is not supported (only the default)"
        if problem is not None:
            return _weights_error(f"Failed to update parameter online: {problem}.")
        async with self._update_lock:
            try:
                # Receive even tensors that will be refused: rank 0 is sending them regardless.
                device = "cuda" if group.backend == "nccl" else "cpu"
                tensors = await asyncio.to_thread(group.receive, dtypes, shapes, device)
                if len(set(names)) != len(names):
                    raise ValueError("names lists a tensor twice")
                arrays = dict(zip(names, map(weight_transfer.to_array, tensors)))
                model = await asyncio.to_thread(self.load_tensors, self.engine.model, arrays)
                await asyncio.to_thread(self.engine.update_weights, model,
                                        abort_in_flight=bool(body.get("abort_all_requests", False)))
            except (RuntimeError, ValueError) as e:  # a broken group or a tensor this model has not
                return _weights_error(f"Failed to update parameter online: {e}.")
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's session around distributed updates, for clients that open one: this server
        swaps whole updates atomically, so it only keeps SGLang's rule that sessions do not nest."""
        if self._weight_session:
            return _weights_error("a weight-update session is already open; call end_weight_update() first")
        self._weight_session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self._weight_session:
            return _weights_error("no weight-update session is open; call begin_weight_update() first")
        self._weight_session = False
        return web.json_response({"success": True, "message": "Success"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        group = self._groups.pop(str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME)), None)
        if group is None:
            return _weights_error("The group to be destroyed does not exist.")
        group.close()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's debug read: a parameter by its HF name, as float32 values (the first
        `truncate_size` rows, default 100)."""
        body = await _json_or_empty(request)
        try:
            name, truncate = str(body["name"]), _int({"truncate_size": 100, **body}, "truncate_size")
        except (KeyError, BadRequest) as e:
            return _error(f"get_weights_by_name: {e if isinstance(e, BadRequest) else f'missing {e}'}")
        if self.read_tensor is None:
            return _error("this server cannot read weights by name")
        try:
            value = await asyncio.to_thread(self.read_tensor, self.engine.model, name)
        except ValueError as e:
            return _error(f"Get parameter by name failed: {e}")
        return web.json_response(np.asarray(value[:truncate], np.float32).tolist())

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


def _weights_error(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


def _int(body: dict, field: str) -> int:
    value = body[field]
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{field} must be an integer, got {value!r}")
    return value


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


def _shielded(handler):
    """The handler run to its end even when aiohttp cancels it because the client went away."""
    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))
    return run


def _sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


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
