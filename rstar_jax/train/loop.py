"""The step loops of a stage: SFT (the SFT stage, or RL's warm-up) and GRPO-RoC RL.

Both number their steps from 1, log one metrics line per step, checkpoint through the run's
`Checkpointer` and resume exactly: SFT's batch order is a function of (seed, epoch) so a resumed run
skips the steps already taken; RL restores the data position, and each step's group ids, sampling
seeds and RoC draw derive from its number.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
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
    # Asynchronous RL (rl.max_staleness): 0 runs each step's rollout, update and push in turn.
    max_staleness: int = 0

    def _evaluation_due(self, step: int) -> bool:
        return bool(self.evaluate and self.eval_every) and (step % self.eval_every == 0 or step == self.steps)

    async def run(self, start: int) -> dict:
        """Returns the last step's metrics (with its evaluation's) and, when evaluations ran, the
        first one's pass@1 as `eval/pass@1_first` (step `eval/first_step`)."""
        self._last: dict = {}
        self._first: dict = {}
        if start == 0 and self._evaluation_due(0):
            evaluation = await self.evaluate(0)  # the policy RL starts from
            self.metrics.write(0, evaluation)
            self._first = {"eval/pass@1_first": evaluation["eval/pass@1"], "eval/first_step": 0}
        self._bar = ProgressBar(self.steps, desc="rl") if self.progress else None
        try:
            if self.max_staleness == 0:
                for step in range(start, self.steps):
                    prompts = [(ex.question, ex.answer) for ex in next(self.prompts)]
                    version = self.trainer.weights_version  # the policy this step samples and trains
                    step_metrics, trajectories = await self.trainer.astep(prompts, step=self.step_offset + step)
                    await self._end_step(step, step_metrics, trajectories, version)
            else:
                await self._run_pipelined(start)
        finally:
            if self._bar:
                self._bar.close()
        return {**self._last, **self._first}

    async def _end_step(self, step: int, step_metrics: dict, trajectories: list, trained_version: int) -> None:
        """Rollout records, the metrics line, the checkpoint and a due evaluation of finished `step`
        (whose update trained the policy of version `trained_version`)."""
        if self.rollouts_run_dir is not None and multihost.is_writer():  # every process has them all
            decode = lambda ids: self.trainer.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            write_records(rollout_path(self.rollouts_run_dir, step + 1),
                          (trajectory_record(t, decode, step=step + 1, stage=self.stage, trained_version=trained_version)
                           for t in trajectories))
        step_metrics["lr"] = self.lr(step)
        if self.scheduler is not None:
            step_metrics.update({f"scheduler/{k}": v for k, v in self.scheduler.stats().items()})
        self._last = self.metrics.write(step + 1, step_metrics)
        self.save_state(step + 1, step + 1 == self.steps)
        if self._evaluation_due(step + 1):
            evaluation = await self.evaluate(step + 1)
            self._last = {**self._last, **self.metrics.write(step + 1, evaluation)}
            self._first = self._first or {"eval/pass@1_first": evaluation["eval/pass@1"], "eval/first_step": step + 1}
        if self._bar:
            self._bar.update(step + 1, reward=f"{step_metrics['rollout/reward_mean']:.2f}",
                             skipped=step_metrics.get("update/skipped", 0))

    async def _run_pipelined(self, start: int) -> None:
        """Asynchronous RL, K = max_staleness >= 1: a producer starts step s's rollouts as soon as step
        s - K - 1 is trained (admission control: a step's tokens are then sampled by a policy at most
        K updates behind the one its update trains), while the trainer takes each step's groups in
        order as they complete, updates off the event loop and pushes the weights in flight.

        The prompts come from a `PromptLookahead`, whose state is the data position of the first
        step not yet trained: a checkpoint taken after step s resumes with steps s + 1 .. s + K
        generated again, from the same prompts with the same group ids (so the same sampling seeds),
        by the restored policy.

        Under several processes each generates its share of a step's groups with no collective;
        the trainer's sequence alone (gather the step's shares, update, push, evaluate, save) holds
        the collectives, in the same order on every process whatever the generation's timing."""
        k = self.max_staleness
        lookahead = self.prompts
        if not isinstance(lookahead, PromptLookahead):
            raise TypeError("RLLoop: max_staleness >= 1 takes its prompts as a PromptLookahead")
        trained = asyncio.Condition()
        done = {"steps": start}  # steps trained (or skipped) so far
        generations: dict[int, asyncio.Future] = {s: asyncio.get_running_loop().create_future()
                                                  for s in range(start, self.steps)}
        waits = {"generator": 0.0}
        rollouts = _Activity()
        # The versions the generators have held (a skipped step pushes none, and a version is the
        # step of its update): staleness counts the updates between a token's version and the trained one.
        held = [self.trainer.weights_version]

        async def produce() -> None:
            for step in range(start, self.steps):
                t0 = time.perf_counter()
                async with trained:
                    await trained.wait_for(lambda: done["steps"] >= step - k)
                waits["generator"] += time.perf_counter() - t0
                prompts = [(ex.question, ex.answer) for ex in lookahead.pull()]
                rollouts.begin()
                task = asyncio.ensure_future(self.trainer.generate(prompts, step=self.step_offset + step,
                                                                   own_share=True))
                task.add_done_callback(lambda t, s=step: (rollouts.end(), _settle(generations[s], t)))

        producer = asyncio.ensure_future(produce())
        window_start, busy_before = time.perf_counter(), 0.0  # each step's window ends at its metrics
        try:
            for step in range(start, self.steps):
                t0 = time.perf_counter()
                waiter = generations[step]
                await asyncio.wait({waiter, producer}, return_when=asyncio.FIRST_COMPLETED)
                if producer.done() and producer.exception() is not None:
                    raise producer.exception()
                own, rollout_s = await waiter
                trajectories = self.trainer.gather_shares(own)
                trainer_wait = time.perf_counter() - t0
                global_step = self.step_offset + step
                version = self.trainer.weights_version  # the policy this step's update trains
                kept, staleness = drop_stale_groups(trajectories, held, k)
                t1 = time.perf_counter()
                step_metrics = await self.trainer.finish(trajectories, step=global_step, rollout_s=rollout_s,
                                                         in_thread=True, train_on=kept)
                if self.trainer.weights_version != held[-1]:
                    held.append(self.trainer.weights_version)
                step_metrics.update(staleness)
                now, busy = time.perf_counter(), rollouts.total()
                window = max(1e-9, now - window_start)
                # Shares of the step's wall time: the trainer in its update and push; the generators
                # with at least one of this process's rollouts in flight.
                step_metrics.update({"async/trainer_wait_s": trainer_wait,
                                     "async/generator_wait_s": waits["generator"],
                                     "async/trainer_busy": (now - t1) / window,
                                     "async/generator_busy": (busy - busy_before) / window,
                                     "time/step_s": window})
                window_start, busy_before = now, busy
                waits["generator"] = 0.0
                lookahead.trained()
                async with trained:
                    done["steps"] = step + 1
                    trained.notify_all()
                await self._end_step(step, step_metrics, kept, version)  # records: what was trained
        finally:
            producer.cancel()
            for future in generations.values():
                if not future.done():
                    future.cancel()
            # Rollouts of steps not trained end with the run; let their tasks see the cancellation.
            await asyncio.gather(producer, return_exceptions=True)


class _Activity:
    """Wall time with at least one task in flight, accumulated."""

    def __init__(self):
        self.inflight, self.since, self.busy = 0, 0.0, 0.0

    def begin(self) -> None:
        if self.inflight == 0:
            self.since = time.perf_counter()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.busy += time.perf_counter() - self.since

    def total(self) -> float:
        return self.busy + (time.perf_counter() - self.since if self.inflight else 0.0)


def _settle(future: asyncio.Future, task: asyncio.Task) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def drop_stale_groups(trajectories: list, held: list[int], max_staleness: int) -> tuple[list, dict]:
    """The groups whose every sampled token is at most `max_staleness` updates behind the policy
    the update trains (the last of `held`, the versions the generators have held in order), and the
    staleness metrics: mean and max over sampled tokens, the share of tokens at each staleness, and
    the groups dropped as too stale. A token's staleness is the number of versions held after its own."""
    by_group: dict[int, list] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    kept, dropped = [], 0
    counts: dict[int, int] = {}
    for group in by_group.values():
        lags = [len(held) - bisect.bisect_right(held, v)
                for t in group for v, m in zip(t.policy_versions, t.loss_mask) if m]
        if lags and max(lags) > max_staleness:
            dropped += 1
            continue
        kept += group
        for lag in lags:
            counts[lag] = counts.get(lag, 0) + 1
    tokens = sum(counts.values())
    metrics: dict = {"async/stale_groups_dropped": dropped}
    if tokens:
        metrics["async/staleness_mean"] = sum(lag * n for lag, n in counts.items()) / tokens
        metrics["async/staleness_max"] = max(counts)
        metrics.update({f"async/staleness_{lag}_share": counts.get(lag, 0) / tokens
                        for lag in range(max_staleness + 1)})
    return kept, metrics


class PromptLookahead:
    """A `PromptIterator` read ahead by an asynchronous run: `pull()` takes the next step's prompts,
    `trained()` marks the oldest pulled step trained, and `get_state()` is the data position of the
    first step not yet trained (what a checkpoint must resume from)."""

    def __init__(self, prompts: PromptIterator):
        self.prompts = prompts
        self._pending: collections.deque = collections.deque()  # the state before each pulled step

    def pull(self):
        self._pending.append(self.prompts.get_state())
        return next(self.prompts)

    def trained(self) -> None:
        self._pending.popleft()

    def get_state(self) -> dict:
        return self._pending[0] if self._pending else self.prompts.get_state()

    def set_state(self, state: dict, **kw) -> None:
        self._pending.clear()
        self.prompts.set_state(state, **kw)

    def __next__(self):
        return next(self.prompts)
