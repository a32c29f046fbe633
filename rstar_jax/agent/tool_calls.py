"""Parsing the model's tool calls and rendering execution results as observations.

A turn's tool calls are `<tool_call>{"name": ..., "arguments": {"code": ..., "input": ...}}</tool_call>`
blocks (Hermes style). Only the first call of a turn runs by default (verl's max_parallel_calls = 1,
spec §2.3). A malformed call is not dropped: it becomes an observation telling the model what was
wrong, and it counts as a tool error (the paper's definition includes format errors).

Behaviour table (`parse_tool_calls`):

| turn text | result |
|---|---|
| no `<tool_call>` | no calls: the trajectory ends (the normal end after `<answer>`) |
| `<tool_call>` without `</tool_call>` | no calls: the turn ended inside a call (the release's rule) |
| invalid JSON | `ToolCallError` "Failed to decode tool call: ..." |
| JSON without `name` / `arguments`, or arguments not an object | `ToolCallError` naming the field |
| unknown tool name | `ToolCallError` listing the known tools |
| `code` missing or not a string; `input` not a string | `ToolCallError` naming the argument |
| code longer than `max_code_chars` | `ToolCallError` (never sent to the sandbox) |
| two or more calls | the first `max_calls` are returned |
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# Execution statuses (sandbox_service's closed set).
STATUS_OK = "ok"
TIMEOUT_STATUSES = ("timeout",)

# The release's failure reasons (its code-judge service): a non-zero exit has an empty reason, a
# timeout is "worker_timeout", a call the service could not run is "queue_timeout" /
# "internal_error". Keeping these strings keeps the release's text-based error counting comparable.
RELEASE_REASONS = {
    "timeout": "worker_timeout",
    "rejected": "queue_timeout",
    "sandbox_error": "internal_error",
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    code: str
    stdin: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    message: str  # shown to the model as the observation


def parse_tool_calls(turn_text: str, *, tool_names: Sequence[str], max_calls: int = 1,
                     max_code_chars: int = 100_000) -> list[ToolCall | ToolCallError]:
    if "<tool_call>" not in turn_text or "</tool_call>" not in turn_text:
        return []
    out: list[ToolCall | ToolCallError] = []
    for body in _CALL.findall(turn_text)[:max_calls]:
        out.append(_parse_one(body.strip(), tool_names, max_code_chars))
    return out


def _parse_one(body: str, tool_names: Sequence[str], max_code_chars: int) -> ToolCall | ToolCallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"Failed to decode tool call: {e}")
    if not isinstance(call, dict):
        return ToolCallError("Failed to decode tool call: expected a JSON object with 'name' and 'arguments'")
    if "name" not in call:
        return ToolCallError("Invalid tool call: missing field 'name'")
    if "arguments" not in call:
        return ToolCallError("Invalid tool call: missing field 'arguments'")
    name, args = call["name"], call["arguments"]
    if isinstance(args, str):  # some models emit the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError(f"Failed to decode tool call arguments: {e}")
    if name not in tool_names:
        return ToolCallError(f"Unknown tool {name!r}; available tools: {', '.join(tool_names)}")
    if not isinstance(args, dict):
        return ToolCallError("Invalid tool call: 'arguments' must be a JSON object")
    code = args.get("code")
    if not isinstance(code, str):
        return ToolCallError("Invalid tool call: argument 'code' is missing or not a string")
    stdin = args.get("input", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return ToolCallError("Invalid tool call: argument 'input' must be a string")
    if len(code) > max_code_chars:
        return ToolCallError(f"Invalid tool call: code has {len(code)} characters, "
                             f"more than the limit {max_code_chars}")
    return ToolCall(name=name, code=code, stdin=stdin)


def truncate_middle(text: str, max_chars: int, marker: str = "...(truncated)...") -> str:
    """Keeps the first and last halves of an over-long text (verl's 'middle' truncation)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + marker + text[len(text) - (max_chars - half):]


def format_observation(result, *, style: str = "release", max_chars: int = 256, truncation: str = "middle") -> str:
    """Renders an execution result (fields status, stdout, stderr, duration_s) or a parse error.

    release: "Tool call success" / "Tool call failure" + "reason: ..." (`RELEASE_REASONS`), then
    "stdout: ..." and "stderr: ..." when non-empty and "execution time: X.XXs", one per line.
    paper: the bare stdout on success; "tool call failed\nreason: ..." otherwise (the paper's traces).
    The text is then cut to `max_chars` characters (middle: first and last halves kept).
    """
    if isinstance(result, ToolCallError):
        text = result.message
    elif style == "release":
        lines = ["Tool call success" if result.status == STATUS_OK else "Tool call failure"]
        if result.status != STATUS_OK:
            lines.append(f"reason: {RELEASE_REASONS.get(result.status, '')}")
        if result.stdout:
            lines.append(f"stdout: {result.stdout}")
        if result.stderr:
            lines.append(f"stderr: {result.stderr}")
        lines.append(f"execution time: {result.duration_s:.2f}s")
        text = "\n".join(lines)
    elif style == "paper":
        if result.status == STATUS_OK:
            text = result.stdout
        elif result.status in TIMEOUT_STATUSES:
            text = "tool call failed\nreason: timeout"
        else:
            text = f"tool call failed\nreason: {result.status}\nerror message: {result.stderr or result.stdout}"
    else:
        raise ValueError(f"format_observation: style must be 'release' or 'paper', got {style!r}")
    if truncation == "middle":
        return truncate_middle(text, max_chars)
    if truncation == "right":
        return text[:max_chars] if max_chars > 0 else text
    raise ValueError(f"format_observation: truncation must be 'middle' or 'right', got {truncation!r}")
