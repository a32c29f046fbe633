"""Per-trajectory statistics that RoC and the metrics consume.

The paper's definitions (spec §1.4): a tool error is a call whose execution status is not "ok"
(runtime error, timeout, memory/output limits, ...) or a call that could not be parsed; answer tags
are closed `<answer>...</answer>` pairs in the model's own text; turns are assistant turns. The
release's text-based counting (`error` substring, later-turn regex) is available through
`rstar_jax.rl.roc.release_counts_from_text` for comparison.
"""

from __future__ import annotations

import re

PARSE_ERROR = "parse_error"  # the status recorded for a malformed tool call

_ANSWER_PAIR = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_tags(model_text: str) -> int:
    return len(_ANSWER_PAIR.findall(model_text))


def is_tool_error(status: str) -> bool:
    return status != "ok"


def trajectory_stats(trajectory, tokenizer=None) -> dict:
    """The paper's counts for one trajectory, plus the release's text-based counts when a tokenizer
    is given (decoded with special tokens kept, as the release decodes its responses)."""
    stats = {
        "n_turns": trajectory.n_turns,
        "n_tool_calls": trajectory.n_tool_calls,
        "n_tool_errors": trajectory.n_tool_errors,
        "n_answer_tags": trajectory.n_answer_tags,
        "finish_reason": trajectory.finish_reason,
        "truncated": trajectory.truncated,
        "response_tokens": len(trajectory.response_ids),
        "sampled_tokens": trajectory.num_sampled_tokens,
    }
    if tokenizer is not None:
        from rstar_jax.rl.roc import release_counts_from_text

        text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
        stats["release"] = release_counts_from_text(text)
    return stats
