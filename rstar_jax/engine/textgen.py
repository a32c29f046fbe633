"""Text over the token engine, for `rstar_jax.serve`'s text routes (`/generate` with `text`, stop
strings or streaming, and the OpenAI routes).

- `TextDecoder`: a request's output decoded incrementally as SGLang's detokenizer does (a token's
  text appears once its bytes form whole characters), stop strings found as they appear, and the
  text trimmed as SGLang trims it: without `no_stop_trim` the matched stop string (and what follows
  it) or the stop token is left out.
- `TextRequest`: one engine request whose tokens feed a `TextDecoder` as they are sampled; a stop
  string ends the request at the next engine step; `updates()` wakes a streaming writer.
- `JinjaChatTemplate`: a checkpoint's chat template rendered as transformers' `apply_chat_template`
  renders it (the same sandboxed jinja2 environment, `tojson`, `raise_exception` and `strftime_now`),
  so the prompt ids equal transformers'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import pathlib
from typing import Sequence

from rstar_jax.rollout.protocol import FINISH_STOP, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that do not form a whole character yet


class TextDecoder:
    """Decodes one request's output tokens as they arrive and watches for stop strings.

    stop_token_ids: the ids the engine stops on; such a final token's text is left out unless
    `no_stop_trim` (SGLang trims a matched stop token). skip_special_tokens: as SGLang's, for the text.
    """

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []  # tokens added, up to the one that completed a stop string
        self.matched: str | None = None  # the stop string found
        self._text = ""  # whole characters decoded so far
        self._match_at = 0
        self._prefix = self._read = 0  # token offsets of the incremental decode (SGLang's / vLLM's)
        self._sent = 0  # characters handed out by delta()
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    @property
    def done(self) -> bool:
        return self.matched is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> bool:
        """Adds the next sampled token; True once a stop string has appeared (later tokens are ignored)."""
        if self.matched is not None:
            return True
        self.ids.append(int(token))
        if token in self.stop_token_ids and not self.no_stop_trim:
            return False  # the engine ends on it, and its text is trimmed
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            start = len(self._text)
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self._find_stop(start)
        return self.matched is not None

    def _find_stop(self, start: int) -> None:
        best = None
        for s in self.stop:
            at = self._text.find(s, max(0, start - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self._match_at, self.matched = best

    def text(self) -> str:
        """The output text: every token decoded, trimmed at the stop string or stop token."""
        ids = self.ids
        if self.matched is None and ids and ids[-1] in self.stop_token_ids and not self.no_stop_trim:
            ids = ids[:-1]
        text = self._decode(ids)
        if self.matched is not None and not self.no_stop_trim:
            at = text.find(self.matched)
            text = text[:at if at >= 0 else self._match_at]
        return text

    def delta(self, final: bool = False) -> str:
        """Text not handed out before: everything left when `final`; until then, whole characters
        that cannot be the start of a stop string."""
        if final:
            text = self.text()
        elif self.matched is not None:
            text = self._text if self.no_stop_trim else self._text[:self._match_at]
        else:
            text = self._text[:max(0, len(self._text) - self._hold)]
        new = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return new


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens included), as SGLang fills log-prob triples."""
    return [tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


@dataclasses.dataclass
class TextOutcome:
    result: GenerateResult  # tokens up to the one that completed a stop string, when one did
    text: str | None
    matched_stop: str | None  # the stop string that ended it, if any


def output_text(tokenizer, ids: Sequence[int], *, trim_stop_token: bool, skip_special_tokens: bool = True) -> str:
    """A finished output's text without a stop string: the stop token that ended it is left out
    when `trim_stop_token` (SGLang's trim, unless `no_stop_trim`)."""
    return tokenizer.decode(list(ids[:-1] if trim_stop_token and ids else ids), skip_special_tokens=skip_special_tokens)


class TextRequest:
    """One engine request whose tokens are collected (and decoded, given a `decoder`) as they are
    sampled. Use `updates()` to stream, `finish()` for the outcome and `close()` (in a finally) so
    that a caller who leaves early aborts it."""

    def __init__(self, engine, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None,
                 decoder: TextDecoder | None = None):
        self.decoder = decoder
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self._updated = asyncio.Event()
        self.task = asyncio.ensure_future(engine.generate(input_ids, sampling, rid, on_token=self._on_token))

    def _on_token(self, token: int, logprob: float) -> bool:
        if self.decoder is not None and self.decoder.done:
            return True  # sampled before the engine saw the stop: not part of the output
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self._updated.set()
        return self.decoder is not None and self.decoder.add(token)

    async def updates(self):
        """Yields whenever new tokens have arrived, until the request is over."""
        while not self.task.done():
            waiter = asyncio.ensure_future(self._updated.wait())
            try:
                await asyncio.wait({self.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if self._updated.is_set():
                self._updated.clear()
                yield

    async def finish(self) -> TextOutcome:
        """The outcome; `text` is None without a decoder."""
        result = await self.task
        if self.decoder is None:
            return TextOutcome(result, None, None)
        matched = self.decoder.matched
        if matched is not None:  # ended by the stop string: drop what was sampled after it
            versions = None if result.token_versions is None else result.token_versions[:len(self.tokens)]
            result = GenerateResult(list(self.tokens), list(self.logprobs), FINISH_STOP, result.weight_version,
                                    num_retractions=result.num_retractions, cached_tokens=result.cached_tokens,
                                    token_versions=versions)
        return TextOutcome(result, self.decoder.text(), matched)

    def close(self) -> None:
        if not self.task.done():
            self.task.cancel()  # the engine aborts it at its next step


class JinjaChatTemplate:
    """A chat template (jinja2 source) rendered as transformers renders it; `special_tokens`
    (bos_token, eos_token, ...) are visible to it, as transformers passes them."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = ""):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        self._compiled = None

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "JinjaChatTemplate | None":
        """The template of a Hugging Face tokenizer directory: `chat_template.jinja`, else
        tokenizer_config.json's `chat_template` (its "default" entry when it holds several); None
        when there is none."""
        path = pathlib.Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        specials = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[name] = value
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), specials, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        return cls(source, specials, str(config_file))

    def _template(self):
        if self._compiled is None:
            try:
                import jinja2
                import jinja2.ext
                import jinja2.sandbox
            except ImportError as e:
                raise RuntimeError("rendering the chat template needs jinja2 (pip install 'jinja2>=3.1')") from e

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                # As transformers: no HTML escaping, and the json.dumps options templates pass.
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            class Generation(jinja2.ext.Extension):
                # transformers' `{% generation %}` block (marks assistant text); rendered as its body.
                tags = {"generation"}

                def parse(self, parser):
                    lineno = next(parser.stream).lineno
                    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

                def _body(self, caller):
                    return caller()

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.source)
        return self._compiled

    def render(self, messages: list[dict], *, tools: list | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        """The prompt text. Raises ValueError with the template's message when it refuses the messages."""
        template = self._template()
        import jinja2

        try:
            return template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from e
