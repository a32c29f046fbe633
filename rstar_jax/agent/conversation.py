"""SFT conversations as users have them, and their rendering into (text, trained) segments.

A conversation is the messages format of Hugging Face chat templates and OpenAI: `system`, `user`,
`assistant` (`content` and/or structured `tool_calls`, optionally `reasoning_content`) and `tool`
messages, with the conversation's own `tools` (JSON schemas). Two renderings:

- `qwen3`: Qwen3's stock chat template (the `chat_template` of Qwen3's tokenizer_config.json),
  reimplemented segment by segment so the assistant tokens are known exactly. For general SFT data:
  function calling with its own tools, instruction following, multi-turn chat. The ids are those of
  one encode of the whole text, which is what `apply_chat_template` gives.
- `rstar2`: the run's RL protocol (`ChatTemplate`: the release's system prompt and python tool, the
  user prefix, the forced `<reason>`), encoded piece by piece as the rollout loop builds a
  trajectory. For math tool-use data, so SFT meets the exact token layout RL samples in.

Trained tokens are what the model generates: an assistant message's text after its
`<|im_start|>assistant\\n` header (after the forced `<reason>` in rstar2) through its `<|im_end|>`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from rstar_jax.agent.tokenizer import IM_END, IM_START, Tokenizer

CONVERSATION_TEMPLATES = ("rstar2", "qwen3")
ROLES = ("system", "user", "assistant", "tool")

# Qwen3's tools block (its chat template's strings; the rStar2 release uses the same block).
QWEN3_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ConversationError(ValueError):
    """A conversation that cannot be used; the message names the field (`messages[3].tool_calls[0]`)."""


@dataclasses.dataclass(frozen=True)
class ToolCallMessage:
    name: str
    arguments: Any  # a JSON object (rendered with `tojson`) or a string (rendered verbatim)


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCallMessage, ...] = ()
    reasoning_content: str | None = None


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[dict, ...] = ()
    source: str = ""  # "file row N", for messages about this conversation


def tojson(value: Any) -> str:
    # transformers' chat-template `tojson`: json.dumps, default separators, keys unsorted, non-ASCII kept.
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any, where: str, *, allow_none: bool) -> str:
    """A message's content: a string, None (""), or OpenAI's list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, (list, tuple)):
        parts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ConversationError(f"{where}[{i}]: only text parts {{type: text, text: str}} are supported, "
                                        f"got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ConversationError(f"{where}: expected a string, got {type(value).__name__} {value!r}")


def _tool_call(value: Any, where: str) -> ToolCallMessage:
    call = value.get("function") if isinstance(value, dict) and isinstance(value.get("function"), dict) else value
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ConversationError(f"{where}: expected {{function: {{name: str, arguments: object|str}}}} "
                                f"(or {{name, arguments}}), got {value!r}")
    arguments = call.get("arguments", {})
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (dict, str)):
        raise ConversationError(f"{where}.arguments: expected a JSON object or a JSON string, got {arguments!r}")
    return ToolCallMessage(call["name"], arguments)


def parse_conversation(row: Any, source: str = "") -> Conversation:
    """A Conversation from a row `{"messages": [...], "tools": [...] | "<json>"}`; a ConversationError
    names the field. Missing and null fields (parquet fills a struct's absent fields with null) are
    absent; assistant content may be null when the message has tool calls."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConversationError("expected a non-empty 'messages' list")
    parsed = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConversationError(f"{where}: expected {{role: {'|'.join(ROLES)}, content: ...}}, got {m!r}")
        role = m["role"]
        calls = m.get("tool_calls") or ()
        if calls and role != "assistant":
            raise ConversationError(f"{where}.tool_calls: only assistant messages make tool calls")
        if not isinstance(calls, (list, tuple)):
            raise ConversationError(f"{where}.tool_calls: expected a list, got {calls!r}")
        content = _text(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        if role == "assistant" and not content and not calls and not m.get("reasoning_content"):
            raise ConversationError(f"{where}: an assistant message needs content or tool_calls")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ConversationError(f"{where}.reasoning_content: expected a string, got {reasoning!r}")
        parsed.append(Message(role, content, tuple(_tool_call(c, f"{where}.tool_calls[{j}]")
                                                   for j, c in enumerate(calls)), reasoning))
    tools = row.get("tools") or ()
    if isinstance(tools, str):  # datasets often store the schemas as one JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ConversationError(f"tools: not valid JSON ({e})") from None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ConversationError(f"tools: expected a list of JSON schemas (objects), got {tools!r}")
    return Conversation(tuple(parsed), tuple(tools or ()), source)


def hermes_tool_call(call: ToolCallMessage) -> str:
    """A structured call as the model writes it (Qwen3's template; the release's parser reads it)."""
    arguments = call.arguments if isinstance(call.arguments, str) else tojson(call.arguments)
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'



def with_tool_calls(content: str, calls: Sequence[ToolCallMessage], shown: str | None = None) -> str:
    """An assistant message's text (`shown`, default `content`) followed by its calls: a newline
    before each call, except the first when `content` is empty (Qwen3's rule)."""
    return (content if shown is None else shown) + "".join(
        ("\n" if (j or content) else "") + hermes_tool_call(c) for j, c in enumerate(calls))


# -- Qwen3's stock template ------------------------------------------------------------------------

def qwen3_segments(conversation: Conversation) -> list[tuple[str, bool]]:
    """Qwen3's chat template (no generation prompt) as (text, trained) segments.

    As the template: a first system message goes before the tools block; assistant turns after the
    last real user query carry their `<think>` block (an empty one on the last turn), earlier ones
    drop it; consecutive tool messages share one user turn of `<tool_response>` blocks.
    """
    messages = conversation.messages
    segments: list[tuple[str, bool]] = []
    first_system = messages[0].role == "system"
    if conversation.tools:
        system = messages[0].content + "\n\n" if first_system else ""
        tools = "".join("\n" + tojson(t) for t in conversation.tools)
        segments.append((f"{IM_START}system\n{system}{QWEN3_TOOLS_HEADER}{tools}{QWEN3_TOOLS_FOOTER}{IM_END}\n",
                         False))
    elif first_system:
        segments.append((f"{IM_START}system\n{messages[0].content}{IM_END}\n", False))
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        wrapped_result = m.content.startswith("<tool_response>") and m.content.endswith("</tool_response>")
        if m.role == "user" and not wrapped_result:
            last_query = i
            break
    for i, m in enumerate(messages):
        if m.role == "user" or (m.role == "system" and i > 0):
            segments.append((f"{IM_START}{m.role}\n{m.content}{IM_END}\n", False))
        elif m.role == "assistant":
            content, reasoning = m.content, m.reasoning_content
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            shown = content
            if i > last_query and (i == len(messages) - 1 or reasoning):
                shown = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
            body = with_tool_calls(content, m.tool_calls, shown)
            segments += [(f"{IM_START}assistant\n", False), (body + IM_END, True), ("\n", False)]
        elif m.role == "tool":
            opening = f"{IM_START}user" if i == 0 or messages[i - 1].role != "tool" else ""
            closing = f"{IM_END}\n" if i == len(messages) - 1 or messages[i + 1].role != "tool" else ""
            segments.append((f"{opening}\n<tool_response>\n{m.content}\n</tool_response>{closing}", False))
    return segments


# -- ids and loss mask -----------------------------------------------------------------------------

def encode_whole(tokenizer: Tokenizer, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """One encode of the joined text (the ids `apply_chat_template` gives); a token is trained when
    it starts inside a trained segment."""
    text = "".join(t for t, _ in segments)
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained_at = bytearray(len(text) + 1)
    position = 0
    for piece, trained in segments:
        if trained:
            trained_at[position:position + len(piece)] = b"\x01" * len(piece)
        position += len(piece)
    return ids, [int(trained_at[start]) for start, _ in offsets]


def encode_pieces(tokenizer: Tokenizer, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Each segment encoded on its own (the rollout loop's layout: sampled turns never merge with the
    forced `<reason>` before them)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        piece = tokenizer.encode(text)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask
