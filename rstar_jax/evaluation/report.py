"""The evaluation report: per file and overall avg@k pass@1 with its standard error, unbiased
pass@j, response length, tool calls per response, tool-error rate and truncation rate.

It is computed from the records alone, so a resumed run reports exactly what an uninterrupted one
would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rstar_jax.evaluation.metrics import summarize
from rstar_jax.evaluation.questions import EvalError, Question
from rstar_jax.rollout.stats import record_stats

REPORT_FILE = "report.json"


def report_ks(k: int) -> list[int]:
    """pass@j for j = 1, 2, 4, ... up to k, and k itself."""
    ks = {1, k}
    j = 2
    while j < k:
        ks.add(j)
        j *= 2
    return sorted(ks)


def _section(groups: Mapping[str, Sequence[dict]], k: int) -> dict:
    records = [r for group in groups.values() for r in group]
    summary = summarize({key: [r["reward"] for r in group] for key, group in groups.items()}, ks=report_ks(k))
    stats = record_stats(records)
    return {
        **summary.as_dict(),
        "num_samples": len(records),
        "mean_response_length": stats["response_length_mean"],  # model + tool tokens
        "mean_sampled_tokens": stats["sampled_tokens"] / len(records),  # model tokens only
        "tool_calls_per_response": stats["tool_calls_mean"],
        # None (null in report.json) where no response called the tool, or none was correct.
        "tool_error_rate": stats.get("tool_error_rate"),
        "tool_error_rate_positive": stats.get("tool_error_rate_positive"),
        "tool_error_rate_negative": stats.get("tool_error_rate_negative"),
        "positive_with_tool_error": stats.get("positive_with_tool_error"),
        "truncation_rate": stats["truncation_ratio"],
        "mean_turns": stats["turns_mean"],
    }


def build_report(groups: Mapping[str, Sequence[dict]], questions: Sequence[Question], k: int) -> dict:
    """Per file (in config order) and overall metrics from each question's k records."""
    missing = [q.key for q in questions if len(groups.get(q.key, ())) != k]
    if missing:
        raise EvalError(f"report: {len(missing)} questions lack their {k} samples, e.g. {missing[:3]}")
    by_file: dict[str, dict[str, Sequence[dict]]] = {}
    for q in questions:
        by_file.setdefault(q.file, {})[q.key] = groups[q.key]
    return {
        "k": k,
        "files": {file: _section(file_groups, k) for file, file_groups in by_file.items()},
        "overall": _section({q.key: groups[q.key] for q in questions}, k),
    }


def format_report(report: dict) -> str:
    """The report as a table (percentages for rates)."""
    k = report["k"]
    header = (f"{'file':<40} {'questions':>9} {'avg@' + str(k):>8} {'stderr':>7} {'pass@' + str(k):>8} "
              f"{'resp_len':>9} {'tools/resp':>10} {'tool_err':>8} {'trunc':>6}")
    lines = [header]
    rows = list(report["files"].items())
    if len(rows) > 1:
        rows.append(("overall", report["overall"]))
    for name, s in rows:
        label = name if len(name) <= 40 else "..." + name[-37:]
        tool_error = "-" if s["tool_error_rate"] is None else f"{100 * s['tool_error_rate']:.1f}%"
        lines.append(f"{label:<40} {s['num_questions']:>9} {100 * s['avg_at_k']:>7.1f}% "
                     f"{100 * s['avg_at_k_stderr']:>6.1f}% {100 * s[f'pass_at_{k}']:>7.1f}% "
                     f"{s['mean_response_length']:>9.1f} {s['tool_calls_per_response']:>10.2f} "
                     f"{tool_error:>8} {100 * s['truncation_rate']:>5.1f}%")
    return "\n".join(lines)
