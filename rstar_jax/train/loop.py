"""The step loops of a stage: SFT (the SFT stage, or RL's warm-up) and GRPO-RoC RL.

Both number their steps from 1, log one metrics line per step, checkpoint through the run's
`Checkpointer` and resume exactly: SFT's batch order is a function of (seed, epoch) so a resumed run
skips the steps already taken; RL restores the data position, and each step's group ids, sampling
seeds and RoC draw derive from its number.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import jax
from jax.sharding import Mesh

from rstar_jax.data.datasets import PromptIterator
from rstar_jax.parallel import multihost
from rstar_jax.rollout.protocol import Scheduler
from rstar_jax.rollout.records import rollout_path, trajectory_record, write_records
from rstar_jax.train.checkpoint import Checkpointer
from rstar_jax.train.metrics import MetricsWriter, ProgressBar
from rstar_jax.train.sft import SftBatches, sft_step
from rstar_jax.train.step import place_batch
from rstar_jax.train.trainer import RLTrainer


def is_rl_line(record: dict) -> bool:
    """A metrics line written by the RL loop (a step's rollout figures or a held-out evaluation)."""
    return any(key.startswith(("rollout/", "eval/")) for key in record)


def sft_loop(model, optimizer, batches: SftBatches, *, epochs: int, mesh: Mesh | None, chunk_size: int,
             metrics: MetricsWriter, start: int = 0, save: Callable[[int, bool], Any] | None = None,
             progress: bool = True) -> dict:
    """`epochs` passes over `batches`, skipping the first `start` steps; save(step, final) after each."""
    total = epochs * batches.steps_per_epoch()
    bar = ProgressBar(total, desc="sft") if progress else None
    step, last = 0, {}
    try:
        for epoch in range(epochs):
            for batch in batches.epoch(epoch):
                step += 1
                if step <= start:
                    continue
                t0 = time.perf_counter()
                out = jax.device_get(sft_step(model, optimizer, place_batch(batch, mesh), chunk_size))
                last = {"sft/loss": float(out["loss"]), "sft/tokens": float(out["tokens"]),
                        "sft/grad_norm": float(out["grad_norm"]),
                        "time/sft_step_s": time.perf_counter() - t0}
                metrics.write(step, last)
                if save is not None:
                    save(step, step == total)
                if bar:
                    bar.update(step, loss=f"{last['sft/loss']:.3f}")
    finally:
        if bar:
            bar.close()
    return last


@dataclasses.dataclass
class RLLoop:
    """RL steps `start` .. `steps - 1` of `trainer` over `prompts`, with metrics, stored rollouts,
    checkpoints and held-out evaluations (`evaluate(step)` at step 0 when starting afresh, every
    `eval_every` steps and after the last step; 0 turns them off)."""

    trainer: RLTrainer
    prompts: PromptIterator
    steps: int
    metrics: MetricsWriter
    checkpointer: Checkpointer
    save_state: Callable[[int, bool], Any]  # save(step, final): the checkpoint of a finished step
    lr: Callable[[int], float]  # learning rate of a 0-based step
    rollouts_run_dir: pathlib.Path | None = None  # every trajectory into <dir>/rollouts/ (None: not stored)
    stage: str = ""
    scheduler: Scheduler | None = None  # its stats() join the step metrics when given
    evaluate: Callable[[int], Awaitable[dict]] | None = None
    eval_every: int = 0
    progress: bool = True
    # RL steps of the stages this one continues (`train.init_from`): the trainer numbers its steps
    # from there, so group ids, sampling seeds, RoC draws and weight versions never repeat theirs.
    step_offset: int = 0

    def _evaluation_due(self, step: int) -> bool:
        return bool(self.evaluate and self.eval_every) and (step % self.eval_every == 0 or step == self.steps)

    async def run(self, start: int) -> dict:
        """Returns the last step's metrics (with its evaluation's) and, when evaluations ran, the
        first one's pass@1 as `eval/pass@1_first` (step `eval/first_step`)."""
        last: dict = {}
        first: dict = {}
        if start == 0 and self._evaluation_due(0):
            evaluation = await self.evaluate(0)  # the policy RL starts from
            self.metrics.write(0, evaluation)
            first = {"eval/pass@1_first": evaluation["eval/pass@1"], "eval/first_step": 0}
        bar = ProgressBar(self.steps, desc="rl") if self.progress else None
        decode = lambda ids: self.trainer.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        try:
            for step in range(start, self.steps):
                prompts = [(ex.question, ex.answer) for ex in next(self.prompts)]
                step_metrics, trajectories = await self.trainer.astep(prompts, step=self.step_offset + step)
                if self.rollouts_run_dir is not None and multihost.is_writer():  # every process has them all
                    write_records(rollout_path(self.rollouts_run_dir, step + 1),
                                  (trajectory_record(t, decode, step=step + 1, stage=self.stage) for t in trajectories))
                step_metrics["lr"] = self.lr(step)
                if self.scheduler is not None:
                    step_metrics.update({f"scheduler/{k}": v for k, v in self.scheduler.stats().items()})
                last = self.metrics.write(step + 1, step_metrics)
                self.save_state(step + 1, step + 1 == self.steps)
                if self._evaluation_due(step + 1):
                    evaluation = await self.evaluate(step + 1)
                    last = {**last, **self.metrics.write(step + 1, evaluation)}
                    first = first or {"eval/pass@1_first": evaluation["eval/pass@1"], "eval/first_step": step + 1}
                if bar:
                    bar.update(step + 1, reward=f"{step_metrics['rollout/reward_mean']:.2f}",
                               skipped=step_metrics.get("update/skipped", 0))
        finally:
            if bar:
                bar.close()
        return {**last, **first}
