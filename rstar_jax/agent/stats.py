"""Per-trajectory counts read from the model's text, which RoC's penalties consume.

The paper's definitions (spec §1.4): a tool error is a call whose execution status is not "ok"
(runtime error, timeout, memory/output limits, ...) or a call that could not be parsed; answer tags
are closed `<answer>...</answer>` pairs in the model's own text; turns are assistant turns. The
release instead counts from the decoded response (`release_counts`: the `error` substring in tool
responses, answer tags, later assistant turns); `rstar_jax.rl.roc.release_penalty` turns those
counts into its penalty.
"""

from __future__ import annotations

import re

PARSE_ERROR = "parse_error"  # the status recorded for a malformed tool call

_ANSWER_PAIR = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant.*?<\|im_end\|>", re.DOTALL)


def count_answer_tags(model_text: str) -> int:
    return len(_ANSWER_PAIR.findall(model_text))


def is_tool_error(status: str) -> bool:
    return status != "ok"


def release_counts(response_text: str) -> dict[str, int]:
    """The release's counts from a response decoded with special tokens kept (text after the prompt);
    the keyword arguments of `rstar_jax.rl.roc.release_penalty`."""
    blocks = _TOOL_RESPONSE.findall(response_text)
    return {
        "n_tool_responses": len(blocks),
        "n_error_responses": sum("error" in b.lower() for b in blocks),
        "n_answer_open": response_text.count("<answer>"),
        "n_answer_close": response_text.count("</answer>"),
        "n_answer_pairs": count_answer_tags(response_text),
        # The first assistant turn's <|im_start|>assistant is part of the prompt, so only later
        # turns match (the release's behaviour, spec §1.3).
        "n_later_turns": len(_ASSISTANT_TURN.findall(response_text)),
    }
