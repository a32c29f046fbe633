"""OpenAI-compatible routes of `rstar_jax.serve`, as SGLang serves them: `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions` (non-streaming, and streaming as server-sent
events `data: {...}` ending with `data: [DONE]`).

For agent frameworks and evaluation harnesses, not training data: text is re-tokenized here (see
`reference/sglang_api.md` §1). Chat prompts are the checkpoint's chat template rendered as
transformers renders it (`add_generation_prompt=True`, `tools` passed through unless
`tool_choice="none"`, `chat_template_kwargs` as template variables), so `usage.prompt_tokens` is
the length of transformers' `apply_chat_template`. Tool calls come back as text in `content`, as
SGLang returns them without a `--tool-call-parser`.

Sampling: `max_tokens` (completions default 16; chat default the rest of the context),
`temperature`, `top_p`, SGLang's extras `top_k`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `no_stop_trim`, and `stop` strings (the text is cut before the stop string,
which ends the request). `seed` is honoured only with `--enable-deterministic-inference` (SGLang
ignores `sampling_seed` without it). Log-probs are those of the sampled tokens; top log-probs
(completions `logprobs=N`, chat `top_logprobs=N`) come from a forward over prompt + output after
the fact, so they are not offered while streaming. `echo` (completions) prepends the prompt and its
log-probs (the first is null), and allows `max_tokens=0` to score a prompt.

Everything a request sets that this server cannot honour (n > 1, penalties, logit_bias,
constrained decoding, images, non-text response formats, ...) is refused with a 400 that names the
field, in OpenAI's error shape; unknown fields are refused the same way.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from rstar_jax.engine.http_common import dumps, json_response, request_json
from rstar_jax.engine.jax_engine import MAX_STOP_IDS
from rstar_jax.rollout.protocol import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from rstar_jax.engine.textgen import TextDecoder, TextRequest, token_texts

COMPLETION_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (and SGLang's for completions logprobs)

# Fields accepted at their default only (anything else changes the output in a way this server
# cannot produce); the value is the tuple of accepted values.
UNSUPPORTED_AT_DEFAULT: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "min_tokens": (None, 0), "logit_bias": (None, {}),
    "regex": (None,), "json_schema": (None,), "ebnf": (None,), "lora_path": (None,), "suffix": (None, ""),
    "continue_final_message": (None, False), "return_hidden_states": (None, False), "reasoning_effort": (None,),
}
# Fields that do not change the output: identities, storage and routing hints, SGLang's extras
# whose effect needs a parser this server does not run.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "rid", "separate_reasoning",
           "stream_reasoning", "session_params", "priority", "extra_key", "cache_salt"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
          "skip_special_tokens", "no_stop_trim", "seed", "stream", "stream_options", "logprobs"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "response_format", "chat_template_kwargs"}
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning goes by


class ServerError(RuntimeError):
    """The server cannot answer (its install lacks something): HTTP 500 in OpenAI's error shape."""


class OpenAIError(ValueError):
    """A bad request: HTTP 400 in OpenAI's error shape, naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(message: str, *, status: int = 400, param: str | None = None,
                   kind: str = "BadRequestError") -> web.Response:
    error = {"message": message, "type": kind, "param": param, "code": status}
    # SGLang's ErrorResponse fields at the top, OpenAI's `error` object for its clients.
    return json_response({"object": "error", **error, "error": error}, status=status)


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise OpenAIError(f"{param}: {message}", param)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high,
           f"must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    _check(ok, f"must be an integer >= {low}" + (f" and <= {high}" if high is not None else "") + f", got {value!r}",
           name)
    return value


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    _check(isinstance(value, list) and all(isinstance(s, str) for s in value), "must be a string or a list of strings",
           name)
    return tuple(value)


def _token_lists(value: Any) -> list[list[int]] | None:
    """A prompt given as token ids (one list, or a list of lists), else None."""
    def ids(row):
        return isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)

    if ids(value) and value:
        return [value]
    if isinstance(value, list) and value and all(ids(row) for row in value):
        return value
    return None


def finish_reason(reason: str) -> str:
    return {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort"}[reason]


class OpenAIRoutes:
    """The routes over an `EngineServer` (its engine, tokenizer, chat template, served model name,
    stop ids and metrics)."""

    def __init__(self, server):
        self.server = server

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("GET", "/v1/models", self.models), ("POST", "/v1/completions", self.completions),
                ("POST", "/v1/chat/completions", self.chat_completions)]

    # -- helpers ------------------------------------------------------------------------------
    @property
    def engine(self):
        return self.server.engine

    async def _body(self, request: web.Request, allowed: set[str]) -> dict:
        if request.content_type != "application/json":
            raise OpenAIError(f"Content-Type must be application/json, got {request.content_type!r}", "Content-Type")
        try:
            body = await request_json(request)
        except ValueError as e:
            raise OpenAIError(f"request body is not valid JSON: {e}", None) from None
        _check(isinstance(body, dict), "must be a JSON object", "body")
        if self.server.tokenizer is None:
            raise OpenAIError("this route needs a tokenizer, and the server runs without one "
                              "(--skip-tokenizer-init, or a preset model); use /generate with input_ids", None)
        for name, accepted in UNSUPPORTED_AT_DEFAULT.items():
            if name in body and body[name] not in accepted:
                raise OpenAIError(f"{name}={body[name]!r} is not supported by this server", name)
        unknown = sorted(set(body) - allowed - set(UNSUPPORTED_AT_DEFAULT) - IGNORED)
        if unknown:
            raise OpenAIError(f"unknown field(s) {unknown}", unknown[0])
        return body

    def _sampling(self, body: dict, max_tokens: int, prompt_len: int) -> tuple[SamplingParams, TextDecoder]:
        limit = self.engine.max_length
        _check(0 < prompt_len < limit, f"{prompt_len} prompt tokens do not fit the context length {limit}",
               "messages" if "messages" in body else "prompt")
        stop_ids = body.get("stop_token_ids") or []
        vocab = self.engine.vocab_size
        _check(isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                  for t in stop_ids),
               f"must be a list of token ids in [0, {vocab})", "stop_token_ids")
        eos = () if body.get("ignore_eos") else self.server.stop_token_ids
        stop_token_ids = tuple(dict.fromkeys([*stop_ids, *eos]))
        seed = _integer(body, "seed", None, -2**63, 2**63 - 1)
        try:
            sampling = SamplingParams(
                max_new_tokens=max(1, min(max_tokens, limit - prompt_len)),
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
                top_k=_integer(body, "top_k", -1, -1),
                stop_token_ids=stop_token_ids,
                seed=seed if self.server.deterministic else None)
        except ValueError as e:
            raise OpenAIError(str(e), None) from None
        if len(stop_token_ids) > MAX_STOP_IDS:
            raise OpenAIError(f"at most {MAX_STOP_IDS} stop token ids (eos included), "
                              f"got {len(stop_token_ids)}", "stop_token_ids")
        decoder = TextDecoder(self.server.tokenizer, stop=_strings(body.get("stop"), "stop"),
                              stop_token_ids=stop_token_ids,
                              skip_special_tokens=body.get("skip_special_tokens", True) is not False,
                              no_stop_trim=bool(body.get("no_stop_trim", False)))
        return sampling, decoder

    def _stream_options(self, body: dict) -> bool:
        options = body.get("stream_options")
        if options is None:
            return False
        _check(isinstance(options, dict) and set(options) <= {"include_usage", "continuous_usage_stats"},
               "must be an object with include_usage", "stream_options")
        return bool(options.get("include_usage"))

    @staticmethod
    def _matched(outcome) -> int | str | None:
        if outcome.matched_stop is not None:
            return outcome.matched_stop
        result = outcome.result
        return result.token_ids[-1] if result.finish_reason == FINISH_STOP and result.token_ids else None

    async def _run(self, ids: list[int], sampling: SamplingParams, decoder: TextDecoder, write=None):
        """Runs one request; `write(delta_text, new_tokens, new_logprobs)` (streaming) hears each update
        that brought tokens (the text may be empty: held back as a possible stop string's start)."""
        started = time.perf_counter()
        request = TextRequest(self.engine, ids, sampling, None, decoder)
        try:
            sent = 0
            if write is not None:
                async for _ in request.updates():
                    delta = decoder.delta()
                    tokens, logprobs = request.tokens[sent:], request.logprobs[sent:]
                    sent = len(request.tokens)
                    await write(delta, tokens, logprobs)
            outcome = await request.finish()
            if write is not None:
                tail = decoder.delta(final=True)
                kept = outcome.result.token_ids
                if tail or len(kept) > sent:
                    await write(tail, kept[sent:], outcome.result.logprobs[sent:])
        finally:
            request.close()
        self.server.record_request(len(ids), outcome.result, started)
        return outcome

    def _sse(self, response: web.StreamResponse, payload) -> Any:
        data = payload.encode() if isinstance(payload, str) else dumps(payload)
        return response.write(b"data: " + data + b"\n\n")

    async def _stream_response(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    # -- routes -------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        s = self.server
        return json_response({"object": "list", "data": [{
            "id": s.served_model_name, "object": "model", "created": int(s.started), "owned_by": "sglang",
            "root": s.served_model_name, "parent": None, "max_model_len": self.engine.max_length}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, COMPLETION_FIELDS)
            prompt = body.get("prompt")
            token_prompts = _token_lists(prompt)
            if token_prompts is not None:
                vocab = self.engine.vocab_size
                _check(all(0 <= t < vocab for row in token_prompts for t in row), f"token ids must lie in [0, {vocab})",
                       "prompt")
                prompts, texts = token_prompts, [None] * len(token_prompts)
            else:
                texts = _strings(prompt, "prompt")
                _check(bool(texts), "is required (a string, a list of strings, or token ids)", "prompt")
                prompts = [self.server.tokenizer.encode(t) for t in texts]
            echo = bool(body.get("echo", False))
            max_tokens = _integer(body, "max_tokens", COMPLETION_MAX_TOKENS, 0)
            _check(max_tokens > 0 or echo, "must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
            n_logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
            stream = bool(body.get("stream", False))
            include_usage = self._stream_options(body)
            if stream:
                _check(len(prompts) == 1, "stream=true takes one prompt", "prompt")
                _check(not n_logprobs, "top log-probs (logprobs > 0) are not streamed by this server; use 0 or "
                       "stream=false", "logprobs")
                _check(max_tokens > 0, "must be >= 1 when streaming", "max_tokens")
            plans = [(ids, text, *self._sampling(body, max_tokens, len(ids))) for ids, text in zip(prompts, texts)]
        except OpenAIError as e:
            return error_response(str(e), param=e.param)
        model = body.get("model") or self.server.served_model_name
        rid, created = f"cmpl-{secrets.token_hex(16)}", int(time.time())
        if stream:
            return await self._stream_completion(request, plans[0], echo, model, rid, created, include_usage,
                                                 n_logprobs)
        choices = await asyncio.gather(*(self._completion_choice(i, plan, echo, max_tokens, n_logprobs)
                                         for i, plan in enumerate(plans)))
        usage = self._usage(sum(len(plan[0]) for plan in plans), sum(c.pop("_completion_tokens") for c in choices),
                            sum(c.pop("_cached") for c in choices))
        return json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": list(choices), "usage": usage})

    async def _completion_choice(self, index: int, plan, echo: bool, max_tokens: int, n_logprobs: int | None) -> dict:
        ids, prompt_text, sampling, decoder = plan
        tok = self.server.tokenizer
        if max_tokens == 0:  # echo only: the prompt is scored, nothing generated
            out_ids, out_logprobs, text, reason, matched, cached = [], [], "", "length", None, 0
        else:
            outcome = await self._run(ids, sampling, decoder)
            result = outcome.result
            out_ids, out_logprobs, text = result.token_ids, result.logprobs, outcome.text
            reason, matched, cached = finish_reason(result.finish_reason), self._matched(outcome), result.cached_tokens
        logprobs = None
        if n_logprobs is not None:
            tokens, values, tops = token_texts(tok, out_ids), list(out_logprobs), [None] * len(out_ids)
            if echo or n_logprobs:
                scores = await self.server.score_positions(ids, out_ids, sampling, start_len=0 if echo else -1,
                                                           top_n=n_logprobs)
                if n_logprobs:
                    tops = [{tok.decode([i]): v for v, i in row} for row in scores["output_top"]]
                if echo:
                    tokens = token_texts(tok, ids) + tokens
                    values = [v for v, _ in scores["input"]] + values
                    tops = [None if row is None or not n_logprobs else {tok.decode([i]): v for v, i in row}
                            for row in scores["input_top"] or [None] * len(ids)] + tops
            offsets, position = [], 0
            for t in tokens:
                offsets.append(position)
                position += len(t)
            logprobs = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if n_logprobs else None,
                        "text_offset": offsets}
        if echo:
            text = (prompt_text if prompt_text is not None else tok.decode(ids, skip_special_tokens=False)) + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched,
                "_completion_tokens": len(out_ids), "_cached": cached}

    async def _stream_completion(self, request, plan, echo: bool, model: str, rid: str, created: int,
                                 include_usage: bool, n_logprobs: int | None) -> web.StreamResponse:
        ids, prompt_text, sampling, decoder = plan
        tok = self.server.tokenizer
        response = await self._stream_response(request)

        def chunk(text: str, tokens, logprobs, reason=None, matched=None) -> dict:
            lp = None
            if n_logprobs is not None:
                lp = {"tokens": token_texts(tok, tokens), "token_logprobs": list(logprobs), "top_logprobs": None,
                      "text_offset": None}
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": reason,
                                 "matched_stop": matched}]}

        async def write(delta, tokens, logprobs):
            if delta or n_logprobs is not None:
                await self._sse(response, chunk(delta, tokens, logprobs))

        try:
            if echo:
                text = prompt_text if prompt_text is not None else tok.decode(ids, skip_special_tokens=False)
                await self._sse(response, chunk(text, [], []))
            outcome = await self._run(ids, sampling, decoder, write)
            result = outcome.result
            await self._sse(response, chunk("", [], [], finish_reason(result.finish_reason), self._matched(outcome)))
            if include_usage:
                await self._sse(response, {"id": rid, "object": "text_completion", "created": created, "model": model,
                                           "choices": [], "usage": self._usage(len(ids), len(result.token_ids),
                                                                              result.cached_tokens)})
            await self._sse(response, "[DONE]")
        except ConnectionResetError:  # the client left; _run has aborted its request
            return response
        await response.write_eof()
        return response

    # -- chat ---------------------------------------------------------------------------------
    def _messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        _check(isinstance(messages, list) and bool(messages), "must be a non-empty list of messages", "messages")
        out = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            _check(isinstance(message, dict), "must be an object", where)
            _check(message.get("role") in MESSAGE_ROLES, f"role must be one of {list(MESSAGE_ROLES)}, "
                   f"got {message.get('role')!r}", where)
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only, joined as SGLang joins them
                texts = []
                for j, part in enumerate(content):
                    _check(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str),
                           "only text parts ({'type': 'text', 'text': ...}) are supported", f"{where}.content[{j}]")
                    texts.append(part["text"])
                content = " ".join(texts)
            else:
                _check(content is None or isinstance(content, str), "must be a string, a list of parts or null",
                       f"{where}.content")
            message = {k: v for k, v in {**message, "content": content}.items() if v is not None}
            reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:  # as transformers: templates read reasoning_content (or thinking)
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            out.append(message)
        return out

    def _chat_prompt(self, body: dict) -> list[int]:
        template = self.server.chat_template
        if template is None:
            raise OpenAIError(f"the tokenizer at {self.server.tokenizer_path} has no chat_template; use "
                              "/v1/completions", "messages")
        tools = body.get("tools")
        _check(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)),
               "must be a list of tool objects", "tools")
        choice = body.get("tool_choice")
        _check(choice in (None, "auto", "none"), "only 'auto' and 'none' are supported (no constrained decoding)",
               "tool_choice")
        response_format = body.get("response_format")
        _check(response_format in (None, {"type": "text"}), "only {'type': 'text'} is supported", "response_format")
        kwargs = body.get("chat_template_kwargs") or {}
        _check(isinstance(kwargs, dict) and not set(kwargs) & {"messages", "tools", "add_generation_prompt"},
               "must be an object of template variables", "chat_template_kwargs")
        try:
            text = template.render(self._messages(body), tools=None if choice == "none" else tools,
                                   add_generation_prompt=True, **kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), "messages") from None
        except RuntimeError as e:  # jinja2 is missing: the server's install, not the request
            raise ServerError(str(e)) from None
        return self.server.tokenizer.encode(text)

    def _chat_logprobs(self, tokens, logprobs, tops) -> dict:
        tok = self.server.tokenizer
        content = []
        for i, (text, value) in enumerate(zip(token_texts(tok, tokens), logprobs)):
            top = []
            if tops is not None:
                top = [{"token": (t := tok.decode([j])), "logprob": v, "bytes": list(t.encode())} for v, j in tops[i]]
            content.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, CHAT_FIELDS)
            ids = self._chat_prompt(body)
            limit = self.engine.max_length
            max_tokens = _integer(body, "max_completion_tokens", None, 1)
            max_tokens = _integer(body, "max_tokens", None, 1) if max_tokens is None else max_tokens
            logprobs = body.get("logprobs") or False
            _check(isinstance(logprobs, bool), "must be a boolean", "logprobs")
            top_n = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
            _check(not top_n or logprobs, "needs logprobs=true", "top_logprobs")
            stream = bool(body.get("stream", False))
            include_usage = self._stream_options(body)
            _check(not (stream and top_n), "top log-probs are not streamed by this server; use stream=false",
                   "top_logprobs")
            sampling, decoder = self._sampling(body, limit if max_tokens is None else max_tokens, len(ids))
        except OpenAIError as e:
            return error_response(str(e), param=e.param)
        except ServerError as e:
            return error_response(str(e), status=500, kind="InternalServerError")
        model = body.get("model") or self.server.served_model_name
        rid, created = f"chatcmpl-{secrets.token_hex(16)}", int(time.time())
        if stream:
            return await self._stream_chat(request, ids, sampling, decoder, model, rid, created, include_usage,
                                           logprobs)
        outcome = await self._run(ids, sampling, decoder)
        result = outcome.result
        lp = None
        if logprobs:
            tops = None
            if top_n:
                tops = (await self.server.score_positions(ids, result.token_ids, sampling, start_len=-1,
                                                          top_n=top_n))["output_top"]
            lp = self._chat_logprobs(result.token_ids, result.logprobs, tops)
        choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text, "reasoning_content": None,
                                          "tool_calls": None},
                  "logprobs": lp, "finish_reason": finish_reason(result.finish_reason),
                  "matched_stop": self._matched(outcome)}
        return json_response({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                  "choices": [choice],
                                  "usage": self._usage(len(ids), len(result.token_ids), result.cached_tokens)})

    async def _stream_chat(self, request, ids, sampling, decoder, model: str, rid: str, created: int,
                           include_usage: bool, logprobs: bool) -> web.StreamResponse:
        response = await self._stream_response(request)

        def chunk(delta: dict, reason=None, matched=None, lp=None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
            if reason is not None:
                choice["matched_stop"] = matched
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice]}

        async def write(delta, tokens, values):
            if delta or logprobs:
                lp = self._chat_logprobs(tokens, values, None) if logprobs else None
                await self._sse(response, chunk({"content": delta}, lp=lp))

        try:
            await self._sse(response, chunk({"role": "assistant", "content": ""}))
            outcome = await self._run(ids, sampling, decoder, write)
            result = outcome.result
            await self._sse(response, chunk({}, finish_reason(result.finish_reason), self._matched(outcome)))
            if include_usage:
                await self._sse(response, {"id": rid, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [],
                                           "usage": self._usage(len(ids), len(result.token_ids), result.cached_tokens)})
            await self._sse(response, "[DONE]")
        except ConnectionResetError:  # the client left; _run has aborted its request
            return response
        await response.write_eof()
        return response
