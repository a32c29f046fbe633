"""Evaluation stages: `python -m rstar_jax.evaluate`, `python -m rstar_jax.filter_hard` and RL's
held-out evaluation every `train.eval_every` steps, all sampling through `sample`.

Every question gets k trajectories from the multi-turn tool-using loop, streamed into a resumable
`SampleStore` (see `rstar_jax.evaluation`). The evaluate command samples at the protocol's settings
(`config.eval`: spec §5.4, temperature 0.6, T = 30, a 30K-token budget) on the in-process engine or
on servers (`eval.generator_urls`); RL's periodic evaluation samples the policy being trained at the
same settings, on the run's own generators.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import time
from collections.abc import Mapping, Sequence

import jax

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.config import resolve
from rstar_jax.data.datasets import detect_format
from rstar_jax.errors import ConfigError
from rstar_jax.evaluation.filter_hard import SUMMARY_FILE, WORK_DIR
from rstar_jax.evaluation import (
    REPORT_FILE,
    EvalError,
    Question,
    SampleStore,
    build_report,
    check_prompt_lengths,
    format_report,
    pending_questions,
    sample_groups,
    sampling_settings,
    split_by_solved,
    write_json,
    write_rows,
)
from rstar_jax.parallel import multihost
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.orchestrator import trajectory_runner
from rstar_jax.app import builders
from rstar_jax.train.checkpoint import PolicySource, policy_source
from rstar_jax.train.metrics import ProgressBar

def settings_of(config, loop: LoopConfig, *, k: int, files: Sequence[str], policy: dict) -> dict:
    """Everything that decides an evaluation's samples (a resumed run must match it)."""
    return sampling_settings(loop, k=k, files=files, policy=policy,
                             tokenizer={"kind": config.tokenizer.kind, "path": config.tokenizer.path},
                             template=config.rollout.template, max_prompt_length=config.rollout.max_prompt_length)


async def sample(config, resources: builders.RolloutResources, questions: Sequence[Question], *, k: int,
                 loop: LoopConfig, store: SampleStore, tokenizer: Tokenizer, template: ChatTemplate,
                 desc: str) -> dict[str, list[dict]]:
    """k trajectories per question on `resources`' generators; each finished group goes to `store`."""
    if not questions:
        return {}
    run_one = trajectory_runner(resources.engine, tokenizer, resources.client, config=loop, scorer=resources.scorer,
                                template=template, scheduler=resources.scheduler)
    bar = ProgressBar(len(questions), desc=desc) if config.metrics.progress_bar else None

    def progress(done: int, records: list[dict]) -> None:
        if bar:
            bar.update(done, solved=f"{sum(r['reward'] for r in records):.0f}/{k}")

    try:
        return await sample_groups(run_one, questions, k, store=store,
                                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                   max_concurrency=config.rollout.max_concurrency, on_group=progress)
    finally:
        if bar:
            bar.close()


def sample_questions(config, questions: Sequence[Question], *, k: int, loop: LoopConfig, store: SampleStore,
                     source: PolicySource, desc: str = "eval") -> dict[str, list[dict]]:
    """k records per question (resumed from `store`); the policy is loaded only when something is
    left to sample."""
    try:
        groups = store.open()
        pending = pending_questions(questions, groups, store.samples_path)
        if pending:
            print(f"[{desc}] {len(questions) - len(pending)} of {len(questions)} questions already sampled; "
                  f"sampling {len(pending)} x {k}", flush=True)
            groups.update(_sample_pending(config, pending, k=k, loop=loop, store=store, source=source, desc=desc))
        return {q.key: groups[q.key] for q in questions}
    finally:
        store.close()


def _sample_pending(config, pending, *, k, loop, store, source, desc) -> dict[str, list[dict]]:
    tokenizer, template = builders.tokenizer(config), builders.template(config)
    check_prompt_lengths(pending, tokenizer, template, config.rollout.max_prompt_length)
    engine = None
    if source.kind != "servers":
        model, mesh = builders.build_policy(config, source)
        max_length = config.rollout.max_prompt_length + loop.response_budget
        limit = model.config.max_position_embeddings
        if max_length > limit:
            raise ConfigError(f"config.rollout.max_prompt_length + the response budget = {max_length} exceeds the "
                              f"policy's max_position_embeddings {limit}")
        engine = builders.make_engine(config, model, mesh, max_length=max_length)

    async def run(targets):
        async with builders.rollout_resources(config, targets, engine=engine, urls=source.urls) as resources:
            for line in resources.sandbox_reports:
                print(f"[eval] sandbox {line}", flush=True)
            return await sample(config, resources, pending, k=k, loop=loop, store=store, tokenizer=tokenizer,
                                template=template, desc=desc)

    try:
        with builders.sandbox(config) as targets:
            return asyncio.run(run(targets))
    finally:
        if engine is not None:
            engine.close()


# -- the evaluate command ---------------------------------------------------------------------------

def run_evaluation(config) -> dict:
    """Samples (or resumes), writes `<run_dir>/report.json`, prints the table; returns the report."""
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    e = config.eval
    files = builders.held_out_files(config, files=e.files, field="eval.files")
    questions, load_report = builders.questions(config, files, field="eval.files")
    if load_report.num_skipped:
        print(f"[eval] skipped {load_report.num_skipped} unusable rows {load_report.skipped}: "
              f"{load_report.examples_of_skipped[:3]}", flush=True)
    source = policy_source(hf_path=config.model.hf_path, checkpoint_dir=e.checkpoint_dir,
                           checkpoint_step=e.checkpoint_step, generator_urls=e.generator_urls, prefix="eval")
    loop = resolve.loop_config(config, "eval")
    store = SampleStore(run_dir, settings_of(config, loop, k=e.k, files=files, policy=source.identity()))
    t0 = time.perf_counter()
    groups = sample_questions(config, questions, k=e.k, loop=loop, store=store, source=source, desc="eval")
    report = build_report(groups, questions, e.k)
    write_json(run_dir / REPORT_FILE, report)
    print(format_report(report), flush=True)
    print(f"[eval] {run_dir / REPORT_FILE} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return report


# -- RL's held-out evaluation ------------------------------------------------------------------------

def eval_metrics(section: Mapping) -> dict[str, float]:
    """The logged figures of a report section (`build_report`'s "overall"); a rate without a
    denominator (None in the report) is not logged."""
    figures = {"eval/pass@1": section["avg_at_k"], "eval/pass@1_stderr": section["avg_at_k_stderr"],
               "eval/num_problems": section["num_questions"],
               "eval/tool_calls_mean": section["tool_calls_per_response"],
               "eval/tool_error_rate": section["tool_error_rate"],
               "eval/tool_error_rate_positive": section["tool_error_rate_positive"],
               "eval/tool_error_rate_negative": section["tool_error_rate_negative"],
               "eval/positive_with_tool_error": section["positive_with_tool_error"],
               "eval/response_length_mean": section["mean_response_length"],
               "eval/truncation_rate": section["truncation_rate"]}
    return {name: value for name, value in figures.items() if value is not None}


@dataclasses.dataclass
class HeldOutEvaluation:
    """RL's periodic evaluation of the policy being trained: `config.eval`'s k and sampling on the
    held-out problems, through the run's own generators and sandbox. Samples and the report of step
    N go to `<run_dir>/eval/step_N/` (resumable like the evaluate command's)."""

    config: object
    questions: list[Question]
    files: tuple[str, ...]
    loop: LoopConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    resources: builders.RolloutResources | None = None  # set once the run's event loop holds them

    @classmethod
    def from_config(cls, config, tokenizer: Tokenizer, template: ChatTemplate) -> "HeldOutEvaluation":
        files = builders.held_out_files(config, files=config.data.eval_files)
        questions, _ = builders.questions(config, files, field="data.eval_files")
        check_prompt_lengths(questions, tokenizer, template, config.rollout.max_prompt_length)
        return cls(config, questions, files, resolve.loop_config(config, "eval"), tokenizer, template)

    async def __call__(self, step: int) -> dict[str, float]:
        """Under several processes each samples its contiguous share of the questions into its own
        store (`process_<i>/`); the samples are gathered and the writer process writes the report."""
        config, k = self.config, self.config.eval.k
        directory = pathlib.Path(config.run_dir) / "eval" / f"step_{step}"
        questions, store_dir = self.questions, directory
        if jax.process_count() > 1:
            questions = questions[multihost.share(len(questions))]
            store_dir = directory / f"process_{jax.process_index()}"
        store = SampleStore(store_dir, settings_of(config, self.loop, k=k, files=self.files,
                                                   policy={"kind": "training", "step": step}))
        try:
            groups = store.open()
            pending = pending_questions(questions, groups, store.samples_path)
            groups.update(await sample(config, self.resources, pending, k=k, loop=self.loop, store=store,
                                       tokenizer=self.tokenizer, template=self.template, desc=f"eval@{step}"))
        finally:
            store.close()
        groups = {key: records for part in multihost.allgather_json(groups) for key, records in part.items()}
        report = build_report(groups, self.questions, k)
        if multihost.is_writer():
            write_json(directory / REPORT_FILE, report)
        return eval_metrics(report["overall"])


# -- the stage-3 hard-set filter --------------------------------------------------------------------

def filter_hard_loop(config) -> LoopConfig:
    """The RL rollout settings (the policy as training samples it) with filter_hard's temperature and
    turns where set (stage 3's config: stage 2's)."""
    f = config.filter_hard
    chosen = {name: f[name] for name in ("temperature", "max_turns") if f[name] is not None}
    return dataclasses.replace(resolve.loop_config(config), **chosen)


def run_filter_hard(config) -> dict:
    """Samples (or resumes), writes the rows not solved k of k to filter_hard.output_file; returns
    the summary (also `<run_dir>/filter_hard/summary.json`). The config passed
    `rstar_jax.config.check_filter_hard`."""
    f, d = config.filter_hard, config.data
    inputs = tuple(f.input_files) or tuple(config.data.train_files)
    output = pathlib.Path(f.output_file)
    out_fmt = output.suffix.lower().lstrip(".")
    for path in inputs:
        in_fmt = detect_format(pathlib.Path(path), d.format)
        if in_fmt != out_fmt:
            raise EvalError(f"config.filter_hard.output_file: {output} is {out_fmt} but input {path} is {in_fmt}; "
                            f"the hard set keeps the input's format (use a .{in_fmt} output)")
    field = "filter_hard.input_files" if f.input_files else "data.train_files"
    questions, load_report = builders.questions(config, inputs, field=field)
    source = policy_source(hf_path=config.model.hf_path, checkpoint_dir=f.checkpoint_dir,
                           checkpoint_step=f.checkpoint_step, generator_urls=f.generator_urls, prefix="filter_hard",
                           fallback_dir=config.train.init_from, fallback_field="train.init_from")
    loop = filter_hard_loop(config)
    work = pathlib.Path(config.run_dir) / WORK_DIR
    store = SampleStore(work, settings_of(config, loop, k=f.k, files=inputs, policy=source.identity()))
    groups = sample_questions(config, questions, k=f.k, loop=loop, store=store, source=source, desc="filter_hard")
    kept, dropped = split_by_solved({key: [rec["reward"] for rec in group] for key, group in groups.items()}, f.k)
    kept_set = set(kept)
    selection = [(pathlib.Path(path), [q.row for q in questions if q.file == str(path) and q.key in kept_set])
                 for path in inputs]
    written = write_rows(output, out_fmt, selection)
    summary = {"input_files": list(map(str, inputs)), "output_file": str(output), "k": f.k,
               "problems": len(questions), "kept": len(kept), "dropped_solved_k_of_k": len(dropped),
               "skipped_unusable_rows": load_report.num_skipped, "rows_written": written}
    write_json(work / SUMMARY_FILE, summary)
    print(f"[filter_hard] kept {len(kept)} of {len(questions)} problems, dropped {len(dropped)} solved "
          f"{f.k}/{f.k}" + (f", skipped {load_report.num_skipped} unusable rows" if load_report.num_skipped else "")
          + f" -> {output}", flush=True)
    return summary
