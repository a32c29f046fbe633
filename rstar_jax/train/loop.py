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
import contextlib
import dataclasses
import pathlib
import time
from collections.abc import Awaitable, Callable, Sequence
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
from rstar_jax.train.step import place_batch, skip_schedule_to
from rstar_jax.train.trainer import RLTrainer


def is_rl_line(record: dict) -> bool:
    """A metrics line written by the RL loop (a step's rollout figures or a held-out evaluation)."""
    return any(key.startswith(("rollout/", "eval/")) for key in record)


@dataclasses.dataclass(frozen=True)
class StageAdvance:
    """When an SFT stage other than the last ends early, from step `after_step` on (the schedule is
    constant from there), by whichever criterion holds first:

    - `exact`: every `every` steps, `probe(stage)` -> (reproduced, held out) counts the stage's
      held-out conversations that greedy decoding reproduces (`sft.greedy_reproduced`); the stage
      ends once that share reaches `exact` at `consecutive` measurements in a row (0: not used);
    - `loss`: the mean loss of its last `window` steps falls below `loss` (0: not used).
    """

    loss: float = 0.0
    window: int = 50
    after_step: int = 0
    exact: float = 0.0
    every: int = 25
    probe: Callable[[int], tuple[int, int]] | None = None
    # A skill that has just formed can fall back under the same constant rate before it settles: one
    # measurement at the threshold may catch it in passing (sft.advance_consecutive).
    consecutive: int = 1

    def __post_init__(self):
        if self.exact and self.probe is None:
            raise ValueError("StageAdvance: exact needs a probe")
        if self.consecutive < 1:
            raise ValueError(f"StageAdvance: consecutive must be at least 1, got {self.consecutive}")

    def measures(self, step: int) -> bool:
        return bool(self.exact) and step >= self.after_step and step % self.every == 0

    def met(self, reproduced: tuple[int, int]) -> bool:
        """Whether one measurement reaches `exact`."""
        return bool(reproduced[1]) and reproduced[0] / reproduced[1] >= self.exact

    def reason(self, step: int, losses: Sequence[float], reproduced: tuple[int, int] | None,
               streak: int = 1) -> str:
        """Why the stage ends after `step` ('' while it goes on); `streak`: the measurements in a row,
        this one included, that reached `exact`."""
        if step < self.after_step:
            return ""
        if reproduced is not None and self.met(reproduced) and streak >= self.consecutive:
            in_a_row = f", {streak} measurements in a row" if self.consecutive > 1 else ""
            return (f"{reproduced[0]} of its {reproduced[1]} held-out conversations reproduced by greedy decoding "
                    f"({reproduced[0] / reproduced[1]:.3f} >= sft.advance_exact {self.exact:g}{in_a_row})")
        if self.loss and len(losses) == self.window and sum(losses) / len(losses) < self.loss:
            return (f"its last {self.window} steps' mean loss {sum(losses) / len(losses):.4g} < sft.advance_loss "
                    f"{self.loss:g}")
        return ""


def sft_loop(model, optimizer, batches: SftBatches, *, epochs: int, mesh: Mesh | None, chunk_size: int,
             metrics: MetricsWriter, start: int = 0, save: Callable[[int, bool, dict], Any] | None = None,
             progress: bool = True, advance: StageAdvance | None = None, resumed_state: dict | None = None) -> dict:
    """`epochs` passes over `batches`, skipping the first `start` steps; save(step, final, state)
    after each, `state` being what a resumed run passes back as `resumed_state`.

    Steps keep the numbers of the full plan: a stage left early (`advance`) skips its remaining
    numbers, and the learning-rate schedule skips them too, so later stages see the rates planned
    for them. A stage that can end early prints why it ended (its criterion, or its last step) and
    logs `sft/held_out_reproduced` at each measurement."""
    total = epochs * batches.steps_per_epoch()
    bar = ProgressBar(total, desc="sft", start_step=start) if progress else None
    step, last = 0, {}
    stage_steps = batches.stage_steps()
    try:
        for epoch in range(epochs):
            for stage, stage_batches in enumerate(batches.epoch_stages(epoch)):
                stage_end = step + stage_steps[stage]
                if stage_end <= start:
                    step = stage_end
                    continue
                can_advance = advance is not None and stage < len(stage_steps) - 1
                # The stage's latest losses and whether it has ended: a resume inside the stage
                # restores them from its checkpoint.
                resumed = (resumed_state or {}) if step < start else {}
                recent = collections.deque(resumed.get("stage_losses", []), maxlen=advance.window if can_advance else 1)
                ended_by = resumed.get("stage_ended", "") if can_advance else ""
                streak = int(resumed.get("stage_streak", 0)) if can_advance else 0
                reproduced = None
                for batch in stage_batches:
                    # Decided after a step and acted on before the next, so a run resumed at the
                    # step that ended its stage ends it too.
                    if ended_by and start <= step:
                        print(f"[sft] stage {stage + 1} ended at step {step} of {stage_end}: {ended_by}", flush=True)
                        skip_schedule_to(optimizer, stage_end)
                        step = stage_end
                        break
                    step += 1
                    if step <= start:
                        continue
                    t0 = time.perf_counter()
                    out = jax.device_get(sft_step(model, optimizer, place_batch(batch, mesh), chunk_size))
                    last = {"sft/loss": float(out["loss"]), "sft/tokens": float(out["tokens"]),
                            "sft/grad_norm": float(out["grad_norm"]), "sft/stage": stage + 1,
                            "time/sft_step_s": time.perf_counter() - t0}
                    recent.append(last["sft/loss"])
                    if can_advance:
                        if advance.measures(step):
                            reproduced = tuple(int(n) for n in advance.probe(stage))
                            last["sft/held_out_reproduced"] = reproduced[0] / max(reproduced[1], 1)
                            streak = streak + 1 if advance.met(reproduced) else 0
                        ended_by = advance.reason(step, recent, reproduced, streak)
                        if not ended_by and step == stage_end:
                            shown = (f"{reproduced[0]} of its {reproduced[1]} held-out conversations reproduced by "
                                     f"greedy decoding when last measured" if reproduced else
                                     f"its last {len(recent)} steps' mean loss {sum(recent) / len(recent):.4g}")
                            print(f"[sft] stage {stage + 1} took all its steps, to {step}, no criterion met: {shown}",
                                  flush=True)
                    metrics.write(step, last)
                    if save is not None:
                        save(step, step == total, {"stage_losses": list(recent) if can_advance else [],
                                                   **({"stage_streak": streak} if streak else {}),
                                                   **({"stage_ended": ended_by} if ended_by else {})})
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
        """Asynchronous RL, K = max_staleness >= 1, with group streaming (AReaL's and verl's
        fully-asynchronous trainers): generation runs ahead in batches of the run's prompts per step,
        each group of 2G reaches the trainer as soon as its last trajectory finishes, and each update
        takes a step's worth of complete groups, whichever batch they came from: first every group
        that would be too stale for the next update (it waits for those: they are trained now or
        never), then the oldest complete ones. So an update waits for a long tail only when the
        bound requires it, and a group is dropped only when more groups fall due at once than a
        step holds.

        Admission control: a new batch starts only while the groups started and not yet taken by the
        trainer stay under (K + 1) batches (AReaL's rule: at most (version + K + 1) x B groups
        started), and under what the remaining steps need. A group taken with a token more than K
        updates behind is dropped whole, and counted. RoC sees whole groups of 2G, as always.

        The prompts come from a `PromptLookahead`: its state is the position of the oldest batch
        with a group not yet taken, plus the groups of it and of later batches already taken. A
        checkpoint after step s resumes by generating the groups not yet taken again, with the same
        group ids (so the same sampling seeds), under the restored policy.

        Under several processes each generates its share of every batch with no collective, and each
        update takes every process's share of a batch's size (its first complete groups); the
        trainer's sequence alone (gather the shares, update, push, evaluate, save) holds the
        collectives, in the same order on every process whatever the generation's timing."""
        k = self.max_staleness
        lookahead = self.prompts
        if not isinstance(lookahead, PromptLookahead):
            raise TypeError("RLLoop: max_staleness >= 1 takes its prompts as a PromptLookahead")
        changed = asyncio.Condition()  # groups ready, a batch failed, or a step trained
        state = {"done": start, "outstanding": 0, "per_step": None, "failure": None}
        ready: dict[int, tuple[list, float, float]] = {}  # group id -> (group, admitted, finished)
        in_flight: set[int] = set()
        admitted_at: dict[int, int] = {}  # group id -> the updates held when it was admitted (len(held))
        waits = {"generator": 0.0}
        rollouts = _Activity()
        # The versions the generators have held (a skipped step pushes none, and a version is the
        # step of its update): staleness counts the updates between a token's version and the trained one.
        held = [self.trainer.weights_version]
        batches: set[asyncio.Task] = set()

        def may_admit() -> bool:
            per_step = state["per_step"]
            if state["done"] >= self.steps:
                return False
            if per_step is None:  # the first batch tells this process's share of a step
                return True
            return state["outstanding"] < min(k + 1, self.steps - state["done"]) * per_step

        async def generate(batch: int, prompts: list, skip: frozenset) -> None:
            admitted = time.perf_counter()
            groups = self.trainer.generate_groups(prompts, step=self.step_offset + batch, skip=skip)
            async with contextlib.aclosing(groups):
                async for group in groups:
                    gid = group[0].group_id
                    async with changed:
                        in_flight.discard(gid)
                        ready[gid] = (group, admitted, time.perf_counter())
                        changed.notify_all()

        async def fail(task: asyncio.Task) -> None:
            async with changed:
                state["failure"] = task.exception()
                changed.notify_all()

        def batch_done(task: asyncio.Task) -> None:
            batches.discard(task)
            rollouts.end()
            if not task.cancelled() and task.exception() is not None:
                asyncio.ensure_future(fail(task))

        async def produce() -> None:
            while True:
                t0 = time.perf_counter()
                async with changed:
                    await changed.wait_for(may_admit)
                waits["generator"] += time.perf_counter() - t0
                batch, examples, skip = lookahead.pull()
                prompts = [(ex.question, ex.answer) for ex in examples]
                step_id = self.step_offset + batch
                own = self.trainer.own_group_ids(prompts, step=step_id)
                if state["per_step"] is None:
                    state["per_step"] = len(own)
                skip_ids = frozenset(step_id * len(prompts) + i for i in skip)
                todo = [gid for gid in own if gid not in skip_ids]
                state["outstanding"] += len(todo)
                in_flight.update(todo)
                admitted_at.update({gid: len(held) for gid in todo})
                rollouts.begin()
                task = asyncio.ensure_future(generate(batch, prompts, skip_ids))
                batches.add(task)
                task.add_done_callback(batch_done)

        def due() -> list[int]:
            """The groups (complete or not) a step's worth of which the next update must take: those
            admitted K updates ago or earlier, whose tokens would be too stale for the update after."""
            return sorted(gid for gid in (*ready, *in_flight) if len(held) - admitted_at[gid] >= k)[:state["per_step"]]

        def batch_ready() -> bool:
            if state["per_step"] is None or len(ready) < state["per_step"]:
                return False
            return all(gid in ready for gid in due())

        def take(count: int) -> tuple[list, list[int], float, int]:
            """`count` complete groups, those due first, then the oldest: their trajectories, group
            ids, the seconds from the first one's admission to the last one's end, and how many of
            them overtook an older group still being generated."""
            first = due()
            gids = sorted(first + [gid for gid in sorted(ready) if gid not in first][:count - len(first)])
            taken = [ready.pop(gid) for gid in gids]
            for gid in gids:
                admitted_at.pop(gid)
            rollout_s = max(f for _, _, f in taken) - min(a for _, a, _ in taken) if taken else 0.0
            overtook = sum(1 for gid in gids if in_flight and gid > min(in_flight))
            return [t for group, _, _ in taken for t in group], gids, rollout_s, overtook

        producer = asyncio.ensure_future(produce())
        window_start, busy_before = time.perf_counter(), 0.0  # each step's window ends at its metrics
        try:
            for step in range(start, self.steps):
                t0 = time.perf_counter()
                async with changed:
                    await changed.wait_for(lambda: state["failure"] is not None or producer.done() or batch_ready())
                    if producer.done():
                        producer.result()  # its error
                    if state["failure"] is not None:
                        raise state["failure"]
                    own, own_ids, rollout_s, overtook = take(state["per_step"])
                # Every process's groups, on every process, in one order whatever the timing.
                trajectories = sorted(self.trainer.gather_shares(own), key=lambda t: (t.group_id, t.sample_index))
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
                                     "async/generator_busy": min(1.0, (busy - busy_before) / window),
                                     "async/groups_overtaking": overtook,
                                     "time/step_s": window})
                window_start, busy_before = now, busy
                waits["generator"] = 0.0
                lookahead.taken(sorted({t.group_id for t in trajectories}), step_offset=self.step_offset)
                async with changed:
                    # Taken groups leave the admission count with their update, not before: at most
                    # (updates + K + 1) steps' worth of groups are ever started.
                    state["done"], state["outstanding"] = step + 1, state["outstanding"] - len(own_ids)
                    if step + 1 == self.steps:  # started, never taken: counted, not lost silently
                        step_metrics["async/groups_left_untaken"] = state["outstanding"]
                    changed.notify_all()
                await self._end_step(step, step_metrics, kept, version)  # records: what was trained
        finally:
            producer.cancel()
            for task in list(batches):
                task.cancel()
            # Rollouts of groups not taken end with the run; let their tasks see the cancellation.
            await asyncio.gather(producer, *batches, return_exceptions=True)


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


def stream_continuation(state: dict, step: int) -> tuple[int, int]:
    """Where a stage that continues another's run (`train.init_from`) picks up its prompt stream,
    from that run's checkpoint: its data `state` and RL `step`. Returns (batches to skip past the
    state's data position, batches the continued run's group numbering moves on by).

    A synchronous run's position follows its last step. An asynchronous one's is its oldest batch
    with a group not yet taken, and later batches may hold groups it trained (`taken`): the stream
    goes on after the last of those, so that no group is trained twice, and the groups of those
    batches it never took (in flight when it stopped) are skipped. Group ids, and so sampling seeds,
    go on as if the stream had."""
    position = int(state.get("batch", step))
    taken = [int(b) for b, _ in state.get("taken", ())]
    skip = max(taken) + 1 - position if taken else 0
    return skip, position + skip


class PromptLookahead:
    """A `PromptIterator` read ahead in batches by an asynchronous run: `pull()` takes the next batch
    (its index, its examples and the indices of its groups already taken before a resume), `taken()`
    marks groups taken by the trainer, and `get_state()` is what a checkpoint must resume from: the
    data position of the oldest batch with a group not yet taken, that batch's index, and the groups
    of it and of later batches already taken."""

    def __init__(self, prompts: PromptIterator, *, batch: int = 0, taken: Sequence[Sequence[int]] = ()):
        self.prompts = prompts
        self._next = batch  # the index of the batch `pull()` returns next
        self._before_taken = {(int(b), int(i)) for b, i in taken}  # (batch, group index) taken before a resume
        # Pulled batches not wholly taken, oldest first: [index, data state before it, size, taken indices].
        self._pending: collections.deque = collections.deque()

    def pull(self) -> tuple[int, list, frozenset[int]]:
        state = self.prompts.get_state()
        examples = next(self.prompts)
        batch, self._next = self._next, self._next + 1
        done = {i for b, i in self._before_taken if b == batch}
        self._before_taken -= {(batch, i) for i in done}
        self._pending.append([batch, state, len(examples), set(done)])
        self._pop_finished()
        return batch, examples, frozenset(done)

    def taken(self, group_ids: Sequence[int], *, step_offset: int = 0) -> None:
        """Marks the groups `group_ids` taken (trained or dropped); a batch's group ids are
        (step_offset + batch) x its size + the group's index, as the trainer numbers them."""
        for gid in group_ids:
            for entry in self._pending:
                first = (step_offset + entry[0]) * entry[2]
                if first <= gid < first + entry[2]:
                    entry[3].add(gid - first)
                    break
        self._pop_finished()

    def _pop_finished(self) -> None:
        while self._pending and len(self._pending[0][3]) == self._pending[0][2]:
            self._pending.popleft()

    def get_state(self) -> dict:
        if not self._pending:
            return {**self.prompts.get_state(), "batch": self._next,
                    "taken": sorted([b, i] for b, i in self._before_taken)}
        batch, state, _, _ = self._pending[0]
        taken = {(entry[0], i) for entry in self._pending for i in entry[3]} | self._before_taken
        return {**state, "batch": batch, "taken": sorted([b, i] for b, i in taken)}

    def set_state(self, state: dict, **kw) -> None:
        self._pending.clear()
        self.prompts.set_state(state, **kw)
        self._next = int(state.get("batch", self._next))
        self._before_taken = {(int(b), int(i)) for b, i in state.get("taken", ())}

    def __next__(self):
        return next(self.prompts)
