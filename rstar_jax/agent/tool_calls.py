"""Parsing the model's tool calls and rendering execution results as observations.

A turn's tool calls are `<tool_call>{"name": ..., "arguments": {"code": ..., "input": ...}}</tool_call>`
blocks (Hermes style). Only the first call of a turn runs by default (verl's max_parallel_calls = 1,
spec §2.3). A malformed call is not dropped: it becomes an observation telling the model what was
wrong, and it counts as a tool error (the paper's definition includes format errors).

Behaviour table (`parse_tool_calls`), for its two `parsing` modes: "release" does what the release's
parser and agent loop do (rStar's tool_parser.py, rstar2_agent_loop.py `_call_tool` and
code_judge_tool.py), "rich" is this project's own (more lenient on string-encoded arguments, stricter
on types, with a code-length limit):

| turn text | "release" | "rich" |
|---|---|---|
| no `<tool_call>` | no calls: the trajectory ends (the normal end, after `<answer>`) | same |
| `<tool_call>` without `</tool_call>` | no calls: the turn ended inside a call | same |
| invalid JSON | "Failed to decode tool call: ..." (the block as written) | same (the block stripped) |
| not an object; no `name` / `arguments` | "Failed to decode tool call: ..." | "Invalid tool call: ..." |
| unknown tool name | E "'<name>'" | "Unknown tool '<name>'; available ..." |
| `arguments` a JSON string | E "'str' object has no attribute 'get'": not run | re-parsed, then as an object |
| `arguments` another non-object | E "'<type>' object has no attribute 'get'" | "Invalid tool call: ..." |
| `code` missing | the empty program runs | "Invalid tool call: ..." |
| `code` not a string | E "'<type>' object has no attribute 'encode'" | "Invalid tool call: ..." |
| `input` missing or null | stdin "" | stdin "" |
| `input` another non-string | E "run_tool_calls_on_server_async failed ..." | "Invalid tool call: ..." |
| code longer than `max_code_chars` | no limit of its own (the sandbox's 1 MiB) | "Invalid tool call: ..." |
| two or more calls | the first `max_calls` | same |

E: "Error when executing tool: " followed by the text of the exception the release's code raises
at that point (its agent loop's message for a call that fails before or while running).

"release" messages are the release's own texts, shown whole (never truncated) as there. The
release's RoC counts tool responses containing "error": the E messages count, "Failed to decode tool
call" ones do not (in the release as here). "rich" messages are truncated like any observation, and
the release's RoC counts none of them; every parse error counts in the paper's RoC (by status).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import traceback
from typing import Sequence

from sandbox_service.harness import FILENAME, release_error

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

CALL_PARSING = ("release", "rich")
OBSERVATION_STYLES = ("release", "paper")

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
    truncate: bool = True  # False: shown whole, as the release shows its parse and call errors


def parse_tool_calls(turn_text: str, *, tool_names: Sequence[str], max_calls: int = 1,
                     max_code_chars: int = 100_000, parsing: str = "rich") -> list[ToolCall | ToolCallError]:
    """The turn's first `max_calls` calls; `parsing` "release" or "rich" (the module's table)."""
    if parsing not in CALL_PARSING:
        raise ValueError(f"parse_tool_calls: parsing must be one of {CALL_PARSING}, got {parsing!r}")
    if "<tool_call>" not in turn_text or "</tool_call>" not in turn_text:
        return []
    out: list[ToolCall | ToolCallError] = []
    for body in _CALL.findall(turn_text)[:max_calls]:
        if parsing == "release":
            out.append(_parse_release(body, tool_names))
        else:
            out.append(_parse_one(body.strip(), tool_names, max_code_chars))
    return out


def _release_error(message: str) -> ToolCallError:
    # The release agent loop's text for an exception raised while preparing or running a call.
    return ToolCallError(f"Error when executing tool: {message}", truncate=False)


def _parse_release(body: str, tool_names: Sequence[str]) -> ToolCall | ToolCallError:
    """One call block, handled as the release's parser and agent loop handle it; the messages are the
    exceptions' texts that the release's code raises at the same point."""
    try:
        call = json.loads(body)
        name, args = call["name"], call["arguments"]  # a non-object raises TypeError, a missing key KeyError
    except Exception as e:  # noqa: BLE001 - the release reports any of them alike
        return ToolCallError(f"Failed to decode tool call: {e}", truncate=False)
    if not isinstance(name, str):  # the release's FunctionCall(name: str) refuses it (pydantic)
        return ToolCallError(f"Failed to decode tool call: 1 validation error for FunctionCall\nname\n  Input should "
                             f"be a valid string [type=string_type, input_value={name!r}, "
                             f"input_type={type(name).__name__}]", truncate=False)
    if name not in tool_names:
        return _release_error(str(KeyError(name)))  # its tool lookup: self.tools[name]
    if not isinstance(args, dict):  # the tool reads parameters.get("code", "")
        return _release_error(f"'{type(args).__name__}' object has no attribute 'get'")
    code, stdin = args.get("code", ""), args.get("input", "")
    if not isinstance(code, str):  # the request builder's code.encode()
        return _release_error(f"'{type(code).__name__}' object has no attribute 'encode'")
    if stdin is None:  # code-judge runs a null input with no stdin
        stdin = ""
    if not isinstance(stdin, str):
        # code-judge's request model refuses a non-string input (HTTP 422) and the release's client
        # gives up after its 4 attempts on the call's batch (here, the call alone).
        return _release_error("run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts.")
    return ToolCall(name=name, code=code, stdin=stdin)


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


def syntax_error_text(code: str, error_format: str = "traceback") -> str | None:
    """What the sandbox writes to stderr for `code` that does not compile (None if it compiles):
    Python's message ("traceback") or the release wrapper's one line ("release")."""
    try:
        if error_format == "release":
            ast.parse(code)  # where the release's wrapper meets it
        else:
            ast.parse(code, FILENAME, "exec")  # as the sandbox's harness parses it, under its file name
    except SyntaxError as e:
        if error_format == "release":
            return release_error(e, code) + "\n"
        return "".join(traceback.format_exception_only(type(e), e))
    return None


def truncate_middle(text: str, max_chars: int, marker: str = "...(truncated)...") -> str:
    """Keeps the first and last halves of an over-long text (verl's 'middle' truncation)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + marker + text[len(text) - (max_chars - half):]


def format_observation(result, *, style: str = "release", max_chars: int = 256, truncation: str = "middle") -> str:
    """Renders an execution result (fields status, stdout, stderr, duration_s) or a parse error.

    release: "Tool call success" / "Tool call failure" + "reason: ..." (`RELEASE_REASONS`), then
    "stdout: ..." and "stderr: ..." when non-empty and "execution time: X.XXs", one per line (rStar's
    code_judge_utils.py `run_tool_calls_on_server_async`).
    paper: the bare stdout on success; "tool call failed\nreason: ..." otherwise (the paper's traces).
    The text is then cut to `max_chars` characters (middle: first and last halves kept), except a
    ToolCallError that is to be shown whole.
    """
    if isinstance(result, ToolCallError):
        if not result.truncate:
            return result.message
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
