"""Evaluation: questions, the resumable sample store, group sampling with the agentic loop, avg@k
reports and the stage-3 hard-set filter. Configs become these objects in `rstar_jax.app.held_out`."""

from rstar_jax.evaluation.filter_hard import split_by_solved, write_rows
from rstar_jax.evaluation.metrics import EvalSummary, pass_at_k, summarize
from rstar_jax.evaluation.questions import EvalError, Question, check_prompt_lengths, load_questions
from rstar_jax.evaluation.report import REPORT_FILE, build_report, format_report, report_ks
from rstar_jax.evaluation.sampling import pending_questions, sample_groups
from rstar_jax.evaluation.store import SAMPLES_FILE, SETTINGS_FILE, SampleStore, sampling_settings, write_json

__all__ = [
    "split_by_solved", "write_rows", "EvalSummary", "pass_at_k", "summarize", "EvalError", "Question",
    "check_prompt_lengths", "load_questions", "REPORT_FILE", "build_report", "format_report", "report_ks",
    "pending_questions", "sample_groups", "SAMPLES_FILE", "SETTINGS_FILE", "SampleStore", "sampling_settings",
    "write_json",
]
