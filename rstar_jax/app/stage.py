"""The launcher's `sft` and `rl` stages, composed from `builders`:

    run_stage(config)   # config validated by rstar_jax.config.validate

tokenizer -> data (synthetic or files) -> policy on the mesh (HF checkpoint or sharded init) ->
optional SFT warm-up -> RL: optimizer, exact resume or `train.init_from`, the engine on the mesh (or
SGLang servers), the sandbox, `RLTrainer` steps with metrics, rollouts, checkpoints and held-out
evaluations -> the final Hugging Face export (the next stage's `model.hf_path`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np
from jax.sharding import Mesh

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.config import resolve
from rstar_jax.data.datasets import DataError, PromptIterator
from rstar_jax.errors import ConfigError
from rstar_jax.app import builders
from rstar_jax.train.checkpoint import Checkpointer, checkpoints_directory
from rstar_jax.app.held_out import HeldOutEvaluation
from rstar_jax.train.loop import PromptLookahead, RLLoop, StageAdvance, is_rl_line, sft_loop, stream_continuation
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.sft import greedy_reproduced
from rstar_jax.train.step import lr_schedule, make_optimizer, place_batch, wsd_decay_start
from rstar_jax.train.trainer import RLTrainer


def run_stage(config) -> dict:
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    builders.continue_previous_stage(config)
    with contextlib.ExitStack() as sandboxes:
        targets: list[str] = []
        if config.mode == "rl":  # a sandbox tool code cannot use is refused before any work
            targets = sandboxes.enter_context(builders.sandbox(config))
            for line in builders.check_sandboxes(config, targets):
                print(f"[rl] sandbox {line}", flush=True)
        return _run_stage(config, run_dir, targets)


def _run_stage(config, run_dir: pathlib.Path, targets: list[str]) -> dict:
    tokenizer, template = builders.tokenizer(config), builders.template(config)
    train_files, sft_files = builders.prepare_data(config)
    model, mesh = builders.build_policy(config)
    metrics = builders.metrics_writer(config)
    checkpointer = builders.checkpointer(config, model, tokenizer)
    summary: dict = {}
    try:
        # A resumed RL run restores the policy from its checkpoint: the warm-up already happened.
        warm_up = config.mode == "rl" and config.sft.before_rl and checkpointer.latest_step() is None
        # The next stage starts from the final export: `--config.model.hf_path=<run_dir>/hf/final`.
        final = run_dir / "hf" / "final" if config.checkpoint.export_hf_final else None
        if config.mode == "sft" or warm_up:
            if not sft_files:
                raise ConfigError("config.sft.train_files: the SFT stage needs a conversations file")
            if warm_up:
                with builders.warm_up_checkpointer(config) as warm_up_checkpointer:
                    summary.update(run_sft(config, model, mesh, tokenizer, template, sft_files, metrics,
                                           warm_up_checkpointer,  # the policy RL starts from
                                           export_to=run_dir / "hf" / "sft_warmup" if final else None))
            else:
                summary.update(run_sft(config, model, mesh, tokenizer, template, sft_files, metrics, checkpointer,
                                       export_to=final))
        if config.mode == "rl":
            summary.update(run_rl(config, model, mesh, tokenizer, template, train_files, metrics, checkpointer,
                                  targets, export_to=final))
    finally:
        checkpointer.close()
        metrics.close()
    return summary


def run_sft(config, model, mesh: Mesh, tokenizer: Tokenizer, template: ChatTemplate, conversation_files,
            metrics: MetricsWriter, checkpointer: Checkpointer | None = None, *,
            export_to: pathlib.Path | None = None) -> dict:
    """The SFT stage (or RL's warm-up): assistant-token NLL, packed, on `sft.schedule`, the files one
    after the other in each epoch, a stage ending early under `sft.advance_exact` or
    `sft.advance_loss`. With a checkpointer (the `sft` mode's, or the warm-up's own) it saves every
    `checkpoint.every_steps` steps and at the end, and resumes from the latest save. `export_to`: an
    HF export of the trained policy (its master weights under `optim.master_weights`) there."""
    batches = builders.sft_batches(config, tokenizer, template, conversation_files, mesh)
    total = config.sft.epochs * batches.steps_per_epoch()
    optimizer_config = resolve.sft_optimizer_config(config, total)
    probe_batches = [batches.held_out_batch(stage) for stage in range(len(batches.stage_steps()))]
    probe_batches = [place_batch(batch, mesh) if batch is not None else None for batch in probe_batches]

    def probe(stage: int) -> tuple[int, int]:
        reproduced, total = greedy_reproduced(model, probe_batches[stage], chunk_size=config.rl.logprob_chunk_size)
        return int(reproduced), int(total)

    advance = _stage_advance(config, batches.stage_steps(), optimizer_config, probe)
    optimizer = make_optimizer(model, optimizer_config)
    start, resumed_state = 0, {}
    if checkpointer is not None and checkpointer.latest_step() is not None:
        restored = checkpointer.restore(model=model, optimizer=optimizer)
        start, resumed_state = restored.step, restored.data_state or {}
        metrics.discard_after(start, where=lambda record: "sft/loss" in record)
        print(f"[sft] resumed from step {start}", flush=True)

    def save(step: int, final: bool, state: dict) -> None:
        checkpointer.save(step, model=model, optimizer=optimizer, data_state={"sft_step": step, **state},
                          stage=config.stage, config=config, force=final)

    summary = sft_loop(model, optimizer, batches, epochs=config.sft.epochs, mesh=mesh,
                       chunk_size=config.rl.logprob_chunk_size, metrics=metrics, start=start,
                       save=save if checkpointer is not None else None, progress=config.metrics.progress_bar,
                       advance=advance, resumed_state=resumed_state)
    if export_to is not None:
        builders.export_hf(config, model, tokenizer, export_to, optimizer)
    return summary


def _stage_advance(config, stage_steps: list[int], optimizer_config,
                   probe: Callable[[int], tuple[int, int]] | None = None) -> StageAdvance | None:
    """`sft.advance_exact` and `sft.advance_loss` as the loop applies them, once the stages' lengths
    are known: a stage that ends early skips its remaining steps in the schedule, so the rate must
    be constant over them. `probe(stage)`: (held-out conversations reproduced, held out)."""
    if not (config.sft.advance_loss or config.sft.advance_exact):
        return None
    field = "sft.advance_exact" if config.sft.advance_exact else "sft.advance_loss"
    if len(stage_steps) < 2:
        raise ConfigError(f"config.{field}: ends an SFT stage other than the last early, but there is one "
                          "stage (one file in sft.train_files, or one entry in data.synthetic.sft_stages); set it to 0")
    last_stage_start = sum(stage_steps[:-1])
    schedule = optimizer_config.schedule
    decay_start = wsd_decay_start(optimizer_config) if schedule == "wsd" else optimizer_config.total_steps
    if schedule == "cosine" or (schedule == "wsd" and decay_start < last_stage_start):
        where = "decays over every step" if schedule == "cosine" else f"decays from step {decay_start}"
        raise ConfigError(f"config.{field}: a stage that ends early skips the rest of its steps, so the rate "
                          f"must be constant until the last stage starts (step {last_stage_start}), but "
                          f"sft.schedule={schedule!r} {where}: use 'wsd' with a sft.decay_ratio of at most "
                          f"{stage_steps[-1] / optimizer_config.total_steps:.4f}, or 'constant'")
    return StageAdvance(loss=config.sft.advance_loss, window=config.sft.advance_window,
                        after_step=optimizer_config.warmup_steps, exact=config.sft.advance_exact,
                        every=config.sft.advance_every, probe=probe, consecutive=config.sft.advance_consecutive)


@dataclasses.dataclass
class RLStart:
    """Where a stage's RL begins: its first step, the RL steps earlier stages took (its step numbers
    continue theirs for group ids, sampling seeds, RoC draws and weight versions) and its prompts."""

    step: int
    step_offset: int
    prompts: PromptIterator
    # The checkpoint's data state when resuming this stage: under rl.max_staleness >= 1 it also says
    # which batch generation resumes from and which of its groups were already taken.
    resumed_state: dict = dataclasses.field(default_factory=dict)

    def data_state(self) -> dict:
        return {**self.prompts.get_state(), "step_offset": self.step_offset}


def _restore(config, model, optimizer, tokenizer: Tokenizer, train_files, metrics: MetricsWriter,
             checkpointer: Checkpointer) -> RLStart:
    """This stage's own checkpoint continues exactly (policy, optimizer, data position, step numbers).
    Else `train.init_from` gives the previous stage's policy (and its optimizer state unless the
    recipe resets it, stage 3) and continues its run: step numbers go on from the previous stage's,
    so no trajectory repeats a sampling seed, and the prompt stream continues where it stopped when
    the data is the same (stage 2; after an asynchronous stage, past every batch it had trained a
    group of: `stream_continuation`); other data (stage 3's hard set) is shuffled with a seed of its own."""
    shuffle_seed = config.data.shuffle_seed
    if checkpointer.latest_step() is not None:
        restored = checkpointer.restore(model=model, optimizer=optimizer)
        state = restored.data_state or {}
        prompts, _ = builders.prompt_iterator(config, train_files, tokenizer, seed=state.get("seed", shuffle_seed))
        if restored.data_state is not None:
            prompts.set_state(restored.data_state)
        metrics.discard_after(restored.step, where=is_rl_line)
        print(f"[rl] resumed from step {restored.step}", flush=True)
        return RLStart(restored.step, int(state.get("step_offset", 0)), prompts, resumed_state=state)
    prompts, _ = builders.prompt_iterator(config, train_files, tokenizer)
    metrics.discard_after(-1, where=is_rl_line)  # RL starts afresh: lines of a run killed before its first save
    if not config.train.init_from:
        return RLStart(0, 0, prompts)
    source = checkpoints_directory(config.train.init_from)
    with Checkpointer(source, async_save=False) as previous:
        restored = previous.restore(model=model, optimizer=optimizer, reset_optimizer=config.optim.reset_at_start)
    state = restored.data_state or {}
    skip, batches = stream_continuation(state, restored.step)
    offset = int(state.get("step_offset", 0)) + batches
    how = "its prompt stream continued"
    try:
        prompts.set_state(state, same_files=False)
        for _ in range(skip):
            next(prompts)
        if skip:
            how += (f" after the {skip} batch(es) its asynchronous rollouts had started ({len(state['taken'])} of "
                    f"their groups trained there, the rest skipped)")
    except (DataError, KeyError):  # other data: its own order, not the previous stage's seed
        prompts, _ = builders.prompt_iterator(
            config, train_files, tokenizer, seed=int(np.random.SeedSequence([shuffle_seed, offset]).generate_state(1)[0]))
        how = "new data, shuffled afresh"
    print(f"[rl] initialised from {source} step {restored.step}"
          + (" (optimizer reset)" if config.optim.reset_at_start else "")
          + f"; steps continue from {offset}, {how}", flush=True)
    return RLStart(0, offset, prompts)


def run_rl(config, model, mesh: Mesh, tokenizer: Tokenizer, template: ChatTemplate, train_files,
           metrics: MetricsWriter, checkpointer: Checkpointer, targets: list[str], *,
           export_to: pathlib.Path | None = None) -> dict:
    """RL against the sandboxes at `targets` (`builders.sandbox`, checked by `builders.check_sandboxes`).
    `export_to`: an HF export of the trained policy (its master weights under `optim.master_weights`)
    there, once the generators are stopped."""
    optimizer_config = resolve.optimizer_config(config)
    optimizer = make_optimizer(model, optimizer_config)
    begin = _restore(config, model, optimizer, tokenizer, train_files, metrics, checkpointer)
    if config.rl.max_staleness >= 1:
        # Read ahead by the producer; checkpoints record the oldest batch with a group not yet taken
        # (checkpoints from before group streaming: the batch of the first step not trained).
        position = begin.resumed_state
        begin = dataclasses.replace(begin, prompts=PromptLookahead(
            begin.prompts, batch=int(position.get("batch", begin.step)), taken=position.get("taken", ())))
    start, prompts = begin.step, begin.prompts
    settings = resolve.rl_settings(config, builders.data_parallel(mesh))
    if settings.max_staleness >= 1:
        print(f"[rl] asynchronous: rollouts run up to {settings.max_staleness} step(s) ahead of the update "
              f"(rl.max_staleness); rollout correction rl.rollout_is={settings.loss.rollout_is}", flush=True)
    evaluation = HeldOutEvaluation.from_config(config, tokenizer, template) if config.train.eval_every else None
    schedule = lr_schedule(optimizer_config)

    def save_state(step: int, final: bool) -> None:
        checkpointer.save(step, model=model, optimizer=optimizer, data_state=begin.data_state(), stage=config.stage,
                          config=config, force=final)

    async def steps(targets: list[str], urls: list[str], engine) -> dict:
        # One event loop for the whole stage: the sandbox client's channels and the generators'
        # HTTP sessions belong to it.
        async with builders.rollout_resources(config, targets, engine=engine, urls=urls,
                                              vocab_size=model.config.vocab_size,
                                              workers=config.rollout.workers) as resources:
            trainer = RLTrainer(model, optimizer, tokenizer, settings, executor=resources.client,
                                scorer=resources.scorer, weight_sync=builders.weight_sync(config, resources),
                                generator=resources.engine, scheduler=resources.scheduler, template=template,
                                mesh=mesh, rollout_workers=resources.workers)
            # Generators may hold any weights (servers start from an export, versions continue
            # across a resume): they sample from the trainer's policy from the first step.
            await trainer.sync_weights(begin.step_offset + start)
            if evaluation is not None:
                evaluation.resources = resources
            loop = RLLoop(trainer, prompts, config.train.steps, metrics, checkpointer, save_state,
                          lr=lambda step: float(schedule(step)),
                          rollouts_run_dir=pathlib.Path(config.run_dir) if config.metrics.save_rollouts else None,
                          # With worker processes this process's scheduler places no turns: no figures.
                          stage=config.stage, scheduler=None if resources.workers else resources.scheduler,
                          evaluate=evaluation,
                          eval_every=config.train.eval_every, progress=config.metrics.progress_bar,
                          step_offset=begin.step_offset, max_staleness=config.rl.max_staleness)
            return await loop.run(start)

    engine = builders.make_engine(config, model, mesh) if config.rollout.backend == "jax" else None
    try:
        with (contextlib.nullcontext([]) if engine is not None else builders.local_servers(config, model)) as urls:
            if urls and config.rollout.local_servers:
                print(f"[rl] generator servers: {' '.join(urls)}", flush=True)
            summary = asyncio.run(steps(targets, urls, engine))
    finally:
        if engine is not None:
            engine.close()
    if export_to is not None:
        builders.export_hf(config, model, tokenizer, export_to, optimizer)
    return summary
