"""avg@k evaluation with the agentic loop: `python -m rstar_jax.evaluate --config=configs/eval.py`.

    python -m rstar_jax.evaluate --config=configs/eval.py --config.model.hf_path=<HF dir> \\
        --config.eval.files="('aime24.json','aime25.json')" --config.run_dir=runs/eval_aime

Every question of `eval.files` gets `eval.k` responses from the multi-turn tool-using loop at the
protocol's settings (spec §5.4: temperature 0.6, T = 30 turns, a 30K-token budget), sampled on the
in-process JaxEngine or on SGLang-compatible servers (`eval.generator_urls`). Run directory:

- `eval_settings.json`: everything that decides the samples (k, sampling, turns, budget, seed, files,
  policy). A restart with different settings is refused: its samples would not be comparable.
- `samples.jsonl`: one `rstar_jax.rollout.records` record per response plus its question key
  (`file#row`); the k records of a question are appended (and fsynced) together as soon as its group
  finishes, so a killed run loses at most the questions in flight and a restart samples only the
  questions without a complete group.
- `report.json`: per file and overall avg@k pass@1 with its standard error, unbiased pass@j,
  mean response length, tool calls per response, tool-error rate and truncation rate. It is
  computed from the records alone, so a resumed run reports exactly what an uninterrupted one would.

The sampling machinery (`sample_questions`) is shared with `python -m rstar_jax.filter_hard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence

from rstar_jax.config import ConfigError
from rstar_jax.data.datasets import DataError, LoadReport, read_examples
from rstar_jax.evaluation.metrics import summarize
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.records import append_records, read_records, trajectory_record, write_records

SAMPLES_FILE = "samples.jsonl"
SETTINGS_FILE = "eval_settings.json"
REPORT_FILE = "report.json"


class EvalError(ValueError):
    """An evaluation that cannot run or resume as asked; the message names the field or file."""


# -- questions ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Question:
    key: str  # "<file>#<row>": how records find their question on resume
    file: str  # the path as the config gives it
    row: int  # 0-based row in that file (`rstar_jax.data.datasets.Example.row`)
    ordinal: int  # position among all questions of the run: the seeded-sampling group id
    question: str
    answer: str


def load_questions(files: Sequence[str], *, fmt: str = "auto", question_key: str = "auto",
                   answer_key: str = "auto", on_bad_row: str = "error",
                   field: str = "eval.files") -> tuple[list[Question], LoadReport]:
    """Every usable row of `files`, in order, keyed by (file, row)."""
    if not files:
        raise EvalError(f"config.{field}: no files to read")
    seen: set[str] = set()
    questions: list[Question] = []
    report = LoadReport()
    for path in files:
        if str(path) in seen:
            raise EvalError(f"config.{field}: {path} is listed twice")
        seen.add(str(path))
        examples, part = read_examples(path, fmt=fmt, question_key=question_key, answer_key=answer_key,
                                       on_bad_row=on_bad_row)
        report.merge(part)
        for ex in examples:
            questions.append(Question(key=f"{path}#{ex.row}", file=str(path), row=ex.row, ordinal=len(questions),
                                      question=ex.question, answer=ex.answer))
    return questions, report


def _eval_files(config) -> tuple[str, ...]:
    """eval.files, or the synthetic held-out set of a synthetic config (written into the run dir)."""
    if config.eval.files:
        return tuple(config.eval.files)
    if not config.data.synthetic.enabled:
        raise EvalError("config.eval.files: evaluation needs at least one file")
    from rstar_jax.data.synthetic import generate_problems, write_problems

    syn = config.data.synthetic
    # The same draw as the training run's held-out set (rstar_jax.data.synthetic.prepare_synthetic_data).
    problems = generate_problems(syn.num_eval, seed=syn.seed + 1, kinds=tuple(syn.kinds), difficulty=syn.difficulty)
    return (str(write_problems(pathlib.Path(config.run_dir) / "data" / "eval.jsonl", problems)),)


# -- the policy -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PolicySource:
    """Where the sampled policy comes from: an HF directory, an orbax checkpoint, or running servers."""

    kind: str  # "hf" | "checkpoint" | "servers"
    path: str = ""  # HF directory or the orbax checkpoints directory
    step: int | None = None  # resolved checkpoint step
    urls: tuple[str, ...] = ()
    field: str = "model.hf_path"  # the config field that named it (for errors)

    def identity(self) -> dict:
        """What eval_settings.json records: the same policy on resume (URLs may change between runs)."""
        if self.kind == "servers":
            return {"kind": "servers"}
        out = {"kind": self.kind, "path": str(pathlib.Path(self.path).resolve())}
        if self.kind == "checkpoint":
            out["step"] = self.step
        return out


def checkpoints_directory(path: str | os.PathLike, field: str) -> pathlib.Path:
    """A run directory or its checkpoints/ directory -> the directory holding step subdirectories."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise EvalError(f"config.{field}: {path} is not a directory")
    nested = path / "checkpoints"
    directory = nested if nested.is_dir() else path
    steps = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
    if not steps:
        raise EvalError(f"config.{field}: no orbax checkpoint steps in {directory} (expected a run directory "
                        f"or its checkpoints/ directory)")
    return directory


def _checkpoint_steps(directory: pathlib.Path) -> list[int]:
    from rstar_jax.train.checkpoint import Checkpointer

    with contextlib.closing(Checkpointer(directory, async_save=False)) as ckpt:
        return ckpt.all_steps()


def policy_source(config, *, checkpoint_dir: str = "", checkpoint_step: int | None = None,
                  generator_urls: Sequence[str] = (), prefix: str = "eval", fallback_dir: str = "",
                  fallback_field: str = "") -> PolicySource:
    """Resolves the policy: servers, else an orbax checkpoint, else model.hf_path, else fallback_dir."""
    if generator_urls:
        return PolicySource("servers", urls=tuple(generator_urls), field=f"{prefix}.generator_urls")
    if checkpoint_dir and config.model.hf_path:
        raise EvalError(f"config.{prefix}.checkpoint_dir: set either model.hf_path (an HF directory) or "
                        f"{prefix}.checkpoint_dir (an orbax run), not both")
    field = f"{prefix}.checkpoint_dir"
    if not checkpoint_dir and not config.model.hf_path and fallback_dir:
        checkpoint_dir, field = fallback_dir, fallback_field
    if checkpoint_dir:
        directory = checkpoints_directory(checkpoint_dir, field)
        steps = _checkpoint_steps(directory)
        if not steps:
            raise EvalError(f"config.{field}: no committed checkpoint in {directory}")
        if checkpoint_step is None:
            step = steps[-1]
        elif checkpoint_step in steps:
            step = checkpoint_step
        else:
            raise EvalError(f"config.{prefix}.checkpoint_step: no step {checkpoint_step} in {directory} "
                            f"(available: {steps})")
        return PolicySource("checkpoint", path=str(directory), step=step, field=field)
    if config.model.hf_path:
        if not pathlib.Path(config.model.hf_path, "config.json").is_file():
            raise EvalError(f"config.model.hf_path: {config.model.hf_path} is not a Hugging Face model directory "
                            f"(no config.json)")
        return PolicySource("hf", path=config.model.hf_path, field="model.hf_path")
    raise EvalError(f"config.{prefix}.checkpoint_dir: no policy: set model.hf_path, {prefix}.checkpoint_dir or "
                    f"{prefix}.generator_urls")


def _stored_model_config(config, stored: dict | None):
    """The checkpoint's model shape (preset, overrides, parameter dtype) with this run's compute settings."""
    import ml_collections

    from rstar_jax.config import model_config

    model = config.model.to_dict()
    saved = (stored or {}).get("model")
    if isinstance(saved, dict):
        for name in ("preset", "param_dtype"):
            if name in saved:
                model[name] = saved[name]
        if isinstance(saved.get("overrides"), dict):
            model["overrides"] = {**model["overrides"], **saved["overrides"]}
    try:
        return model_config(ml_collections.ConfigDict({"model": model}))
    except (ValueError, TypeError) as e:
        raise EvalError(f"the checkpoint's stored config.model does not describe a model: {e}") from None


def _read_stored_config(directory: pathlib.Path, step: int) -> dict | None:
    """The `config` item a checkpoint step holds (the training run's config), or None."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(directory, item_handlers={"config": ocp.JsonCheckpointHandler()},
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return restored["config"] or None
    except (FileNotFoundError, KeyError, ValueError):
        return None
    finally:
        manager.close()


def load_policy(config, source: PolicySource | None = None):
    """The policy as an nnx model on this host's mesh: (model, mesh).

    From `model.hf_path` (an HF directory) or an orbax checkpoint (`eval.checkpoint_dir`: a run
    directory or its checkpoints/ directory, `eval.checkpoint_step` or the latest). A checkpoint's
    model shape comes from the config it stores, else from config.model.
    """
    from rstar_jax.train.run import build_policy

    source = source or policy_source(config, checkpoint_dir=config.eval.checkpoint_dir,
                                     checkpoint_step=config.eval.checkpoint_step)
    if source.kind == "servers":
        raise EvalError(f"config.{source.field}: the policy lives on the servers; there is nothing to load here")
    if source.kind == "hf":
        return build_policy(config)
    import jax

    from rstar_jax.config import check_mesh
    from rstar_jax.parallel import create_sharded_model, make_mesh
    from rstar_jax.train.checkpoint import Checkpointer, CheckpointError

    directory = pathlib.Path(source.path)
    model_cfg = _stored_model_config(config, _read_stored_config(directory, source.step))
    mesh = make_mesh(*check_mesh(config, jax.device_count()))
    rules = tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in config.mesh.rules)
    model = create_sharded_model(model_cfg, mesh, rules, seed=config.seed)
    with contextlib.closing(Checkpointer(directory, async_save=False)) as ckpt:
        try:
            ckpt.restore(source.step, model=model)
        except CheckpointError as e:
            raise EvalError(f"config.{source.field}: {e}") from None
    return model, mesh


# -- sampling settings and the resumable sample store ----------------------------------------------

def loop_config(config, *, temperature: float, top_p: float, top_k: int, max_turns: int,
                response_budget: int) -> LoopConfig:
    """The rollout loop's settings: these sampling values, the rest from config.rollout / sandbox."""
    r = config.rollout
    return LoopConfig(max_turns=max_turns, response_budget=response_budget, temperature=temperature, top_p=top_p,
                      top_k=top_k, tool_name=r.tool_name, max_calls_per_turn=r.max_tool_calls_per_turn,
                      observation_style=r.observation_style, observation_max_chars=r.observation_max_chars,
                      tool_timeout_s=config.sandbox.timeout_s,
                      reward_mode="local" if config.sandbox.verify_via == "local" else "sandbox",
                      seed=config.seed if r.seeded_sampling else None)


def eval_loop_config(config) -> LoopConfig:
    """spec §5.4 settings from config.eval."""
    e = config.eval
    return loop_config(config, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, max_turns=e.max_turns,
                       response_budget=e.response_budget)


def sampling_settings(config, loop: LoopConfig, *, k: int, files: Sequence[str], source: PolicySource) -> dict:
    """Everything that decides the samples; a resumed run must match it exactly."""
    return {
        "k": int(k),
        "files": [str(f) for f in files],
        "policy": source.identity(),
        "tokenizer": {"kind": config.tokenizer.kind, "path": config.tokenizer.path},
        "template": config.rollout.template,
        "max_prompt_length": config.rollout.max_prompt_length,
        "temperature": loop.temperature,
        "top_p": loop.top_p,
        "top_k": loop.top_k,
        "max_turns": loop.max_turns,
        "response_budget": loop.response_budget,
        "tool_name": loop.tool_name,
        "max_calls_per_turn": loop.max_calls_per_turn,
        "observation_style": loop.observation_style,
        "observation_max_chars": loop.observation_max_chars,
        "tool_timeout_s": loop.tool_timeout_s,
        "seed": loop.seed,
    }


class SampleStore:
    """`<directory>/samples.jsonl` and `<directory>/eval_settings.json`: resumable per-question groups."""

    def __init__(self, directory: str | os.PathLike, settings: dict):
        self.directory = pathlib.Path(directory)
        self.settings = json.loads(json.dumps(settings))  # as it reads back from disk
        self.k = int(settings["k"])
        self.samples_path = self.directory / SAMPLES_FILE
        self.settings_path = self.directory / SETTINGS_FILE
        self._lock_file = None

    def open(self) -> dict[str, list[dict]]:
        """Locks the directory, checks (or writes) the settings and returns the complete groups on disk.

        A torn last line or a question with fewer than k records (the run was killed while writing
        it) is removed from samples.jsonl, so the question is sampled again and appears once.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        has_samples = self.samples_path.exists() and self.samples_path.stat().st_size > 0
        if self.settings_path.exists() and has_samples:
            try:
                saved = json.loads(self.settings_path.read_text())
            except json.JSONDecodeError as e:
                raise EvalError(f"{self.settings_path}: not valid JSON ({e.msg})") from None
            if saved != self.settings:
                changed = sorted(set(saved) | set(self.settings), key=str)
                diffs = [f"{name}: {saved.get(name)!r} -> {self.settings.get(name)!r}" for name in changed
                         if saved.get(name) != self.settings.get(name)]
                raise EvalError(f"{self.directory} holds samples drawn with other settings ({'; '.join(diffs)}); "
                                f"resume with the original settings or choose a new config.run_dir")
        elif has_samples:
            raise EvalError(f"{self.samples_path} exists without {SETTINGS_FILE}: it cannot be resumed safely; "
                            f"choose a new config.run_dir")
        else:  # nothing sampled yet: these settings are the run's
            write_json(self.settings_path, self.settings)
        if not self.samples_path.exists():
            return {}
        torn: list[int] = []
        records = read_records(self.samples_path, on_partial=torn.append)
        groups: dict[str, list[dict]] = {}
        for i, record in enumerate(records):
            if "key" not in record or "sample_index" not in record:
                raise EvalError(f"{self.samples_path}: record {i + 1} has no question key; not an evaluation file")
            groups.setdefault(record["key"], []).append(record)
        complete: dict[str, list[dict]] = {}
        for key, group in groups.items():
            indices = sorted(r["sample_index"] for r in group)
            if len(indices) != len(set(indices)) or len(indices) > self.k:
                raise EvalError(f"{self.samples_path}: question {key} has duplicate samples {indices}; "
                                f"the file was edited or concatenated")
            if indices == list(range(self.k)):
                complete[key] = sorted(group, key=lambda r: r["sample_index"])
        if torn or len(complete) != len(groups):
            kept = [r for r in records if r["key"] in complete]
            write_records(self.samples_path, kept)
        return complete

    def append(self, records: Sequence[dict]) -> None:
        append_records(self.samples_path, records)

    def _lock(self) -> None:
        # Two processes appending to one samples.jsonl would interleave groups; the lock dies with
        # its process, so a killed run never leaves the directory locked.
        import fcntl

        if self._lock_file is not None:
            return
        handle = open(self.directory / ".lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise EvalError(f"{self.directory} is in use by another running evaluation") from None
        self._lock_file = handle

    def close(self) -> None:
        """Releases the directory lock."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def write_json(path: pathlib.Path, data) -> None:
    """Atomic JSON write (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# -- sampling ---------------------------------------------------------------------------------------

def check_prompt_lengths(questions: Sequence[Question], tokenizer, template, max_prompt_length: int) -> None:
    """A prompt longer than rollout.max_prompt_length would overflow the engine: name the row."""
    for q in questions:
        n = len(template.prompt_ids(tokenizer, q.question))
        if n > max_prompt_length:
            raise DataError(f"{q.file} row {q.row}: the prompt is {n} tokens, more than "
                            f"config.rollout.max_prompt_length={max_prompt_length}")


def sample_questions(config, questions: Sequence[Question], *, k: int, loop: LoopConfig, store: SampleStore,
                     source: PolicySource, desc: str = "eval") -> dict[str, list[dict]]:
    """k responses per question with the agentic loop; returns every question's k records by key.

    Questions with a complete group in the store are not sampled again. Each finished group is
    appended to the store before the next is awaited. The policy is loaded only when something is
    left to sample.
    """
    try:
        groups = store.open()
        return _sample_missing(config, questions, groups, k=k, loop=loop, store=store, source=source, desc=desc)
    finally:
        store.close()


def _sample_missing(config, questions, groups, *, k, loop, store, source, desc) -> dict[str, list[dict]]:
    from rstar_jax.agent.template import ChatTemplate
    from rstar_jax.agent.tokenizer import load_tokenizer

    known = {q.key: q for q in questions}
    for key, group in groups.items():
        q = known.get(key)
        if q is not None and (group[0].get("question"), group[0].get("gold_answer")) != (q.question, q.answer):
            raise EvalError(f"{store.samples_path}: the records of {key} hold another question or answer than "
                            f"the file now does; the file changed since these samples were drawn")
    pending = [q for q in questions if q.key not in groups]
    if pending:
        print(f"[{desc}] {len(questions) - len(pending)} of {len(questions)} questions already sampled; "
              f"sampling {len(pending)} x {k}", flush=True)
        tokenizer = load_tokenizer(config.tokenizer.kind, config.tokenizer.path or config.model.hf_path or None)
        template = ChatTemplate.from_style(config.rollout.template, config.rollout.tool_name)
        check_prompt_lengths(pending, tokenizer, template, config.rollout.max_prompt_length)
        groups.update(_sample_pending(config, pending, k=k, loop=loop, store=store, source=source,
                                      tokenizer=tokenizer, template=template, desc=desc))
    return {q.key: groups[q.key] for q in questions}


def _sample_pending(config, pending, *, k, loop, store, source, tokenizer, template, desc) -> dict[str, list[dict]]:
    from sandbox_service.launcher import LocalSandbox

    from rstar_jax.rollout.engine import JaxEngine

    engine = None
    if source.kind != "servers":
        model, mesh = load_policy(config, source)
        max_length = config.rollout.max_prompt_length + loop.response_budget
        limit = model.config.max_position_embeddings
        if max_length > limit:
            raise EvalError(f"config.rollout.max_prompt_length + the response budget = {max_length} exceeds the "
                            f"policy's max_position_embeddings {limit}")
        pool = config.rollout.engine.max_total_tokens
        engine = JaxEngine(model, slots=config.rollout.engine.slots, max_length=max_length,
                           max_total_tokens=max(pool, max_length) if pool else None,
                           page_size=config.rollout.engine.page_size, seed=config.seed)
    sandbox = (LocalSandbox(workers=config.sandbox.workers, memory_mb=config.sandbox.memory_mb)
               if config.sandbox.launch_local else contextlib.nullcontext(None))
    try:
        with sandbox as local:
            targets = [local.target] if local is not None else list(config.sandbox.targets)
            return asyncio.run(_sample_async(config, pending, k=k, loop=loop, store=store, source=source,
                                             tokenizer=tokenizer, template=template, engine=engine,
                                             targets=targets, desc=desc))
    finally:
        if engine is not None:
            engine.close()


async def _sample_async(config, pending, *, k, loop, store, source, tokenizer, template, engine, targets,
                        desc) -> dict[str, list[dict]]:
    # One event loop for the whole sampling: the sandbox client's channels and the generators'
    # HTTP sessions belong to it.
    from sandbox_service.client import SandboxClient

    from rstar_jax.agent.reward import make_scorer
    from rstar_jax.rollout.orchestrator import Orchestrator, trajectory_runner
    from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler
    from rstar_jax.rollout.sglang import SGLangGenerator
    from rstar_jax.train.metrics import ProgressBar

    client = SandboxClient(targets)
    scorer = make_scorer(loop.reward_mode, timeout_s=loop.verify_timeout_s, sandbox_client=client)
    generators, scheduler = [], None
    if engine is None:
        generators = [SGLangGenerator(url) for url in source.urls]
        scheduler = (KvScheduler(generators) if config.rollout.scheduler == "kv"
                     else RoundRobinScheduler(generators))
    run_one = trajectory_runner(engine, tokenizer, client, config=loop, scorer=scorer, template=template,
                                scheduler=scheduler)
    max_concurrency = config.rollout.max_concurrency
    orchestrator = Orchestrator(run_one, max_concurrency=max_concurrency)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    # Enough groups in flight to keep every trajectory slot busy, without creating a task for each
    # of tens of thousands of problems up front.
    window = 2 * max(1, math.ceil(max_concurrency / k))
    queue = iter(pending)
    running: dict[asyncio.Future, Question] = {}
    done_groups: dict[str, list[dict]] = {}
    bar = ProgressBar(len(pending), desc=desc) if config.metrics.progress_bar else None

    def start_next() -> None:
        q = next(queue, None)
        if q is not None:
            # group id = the question's ordinal: its seeded samples do not depend on what else runs.
            task = asyncio.ensure_future(orchestrator.collect([(q.question, q.answer)], k, first_group_id=q.ordinal))
            running[task] = q

    try:
        for _ in range(window):
            start_next()
        while running:
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                q = running.pop(task)
                records = [trajectory_record(t, decode, key=q.key, file=q.file, row=q.row) for t in task.result()]
                store.append(records)
                done_groups[q.key] = records
                if bar:
                    bar.update(len(done_groups), solved=f"{sum(r['reward'] for r in records):.0f}/{k}")
                start_next()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if bar:
            bar.close()
        for closer in (getattr(scorer, "close", None), client.close, *(g.close for g in generators)):
            if closer is not None:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
    return done_groups


# -- the report -------------------------------------------------------------------------------------

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
    calls = sum(r["n_tool_calls"] for r in records)
    errors = sum(r["n_tool_errors"] for r in records)
    n = len(records)
    return {
        **summary.as_dict(),
        "num_samples": n,
        "mean_response_length": sum(r["response_length"] for r in records) / n,  # model + tool tokens
        "mean_sampled_tokens": sum(r["num_sampled_tokens"] for r in records) / n,  # model tokens only
        "tool_calls_per_response": calls / n,
        "tool_error_rate": errors / calls if calls else 0.0,
        "truncation_rate": sum(bool(r["truncated"]) for r in records) / n,
        "mean_turns": sum(r["n_turns"] for r in records) / n,
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
        lines.append(f"{label:<40} {s['num_questions']:>9} {100 * s['avg_at_k']:>7.1f}% "
                     f"{100 * s['avg_at_k_stderr']:>6.1f}% {100 * s[f'pass_at_{k}']:>7.1f}% "
                     f"{s['mean_response_length']:>9.1f} {s['tool_calls_per_response']:>10.2f} "
                     f"{100 * s['tool_error_rate']:>7.1f}% {100 * s['truncation_rate']:>5.1f}%")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------

def run_evaluation(config) -> dict:
    """Samples (or resumes), writes `<run_dir>/report.json`, prints the table; returns the report."""
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    e = config.eval
    files = _eval_files(config)
    d = config.data
    questions, load_report = load_questions(files, fmt=d.format, question_key=d.question_key,
                                            answer_key=d.answer_key, on_bad_row=d.on_bad_row)
    if load_report.num_skipped:
        print(f"[eval] skipped {load_report.num_skipped} unusable rows {load_report.skipped}: "
              f"{load_report.examples_of_skipped[:3]}", flush=True)
    source = policy_source(config, checkpoint_dir=e.checkpoint_dir, checkpoint_step=e.checkpoint_step,
                           generator_urls=e.generator_urls, prefix="eval")
    loop = eval_loop_config(config)
    store = SampleStore(run_dir, sampling_settings(config, loop, k=e.k, files=files, source=source))
    t0 = time.perf_counter()
    groups = sample_questions(config, questions, k=e.k, loop=loop, store=store, source=source, desc="eval")
    report = build_report(groups, questions, e.k)
    write_json(run_dir / REPORT_FILE, report)
    print(format_report(report), flush=True)
    print(f"[eval] {run_dir / REPORT_FILE} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return report


def run_or_exit(run, config) -> None:
    """Runs `run(config)`; an input error (config, data, resume) exits with status 2 and its message."""
    from absl import flags, logging

    if flags.FLAGS.is_parsed() and not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    try:
        run(config)
    except (ConfigError, EvalError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def config_command(default_config: str | os.PathLike, run) -> None:
    """The absl entry point shared by this command and filter_hard: `--config=FILE` (default
    `default_config`) with `--config.a.b=v` overrides, then `run_or_exit(run, config)`."""
    from absl import app
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", str(default_config),
                                                  "Path to a config file (get_config()).", lock_config=True)

    def entry(argv) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        run_or_exit(run, config_flag.value)

    app.run(entry)


def main() -> None:
    from rstar_jax.config import REPO_CONFIGS, validate

    def run(config) -> None:
        config.mode = "eval"  # any stage config evaluates its policy the same way
        run_evaluation(validate(config))

    config_command(REPO_CONFIGS / "eval.py", run)


if __name__ == "__main__":
    main()
