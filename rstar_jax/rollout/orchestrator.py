"""Launches G' trajectories per prompt with bounded concurrency and streams finished groups.

Every trajectory is its own asyncio task (no per-turn barrier across the batch); a group is yielded
as soon as its last trajectory finishes. Closing the iterator (`contextlib.aclosing`, or when the
loop finalises it) or cancelling the consumer cancels every outstanding trajectory and waits for it,
so no task or sandbox call is leaked. Leaving an `async for` early without `aclosing` defers that
clean-up to the asyncio finaliser, so wrap the iteration when the caller goes on running.

While trajectories run, the cyclic garbage collector is tuned for a rollout (`freeze_gc=False`
leaves it alone): the objects that existed before the first trajectory started are kept out of it
(`gc.freeze()`), and it runs its youngest pass every GC_YOUNG_THRESHOLD container allocations
instead of every 700; both are undone once no orchestrator has trajectories running. A rollout
allocates a container per token it parses (SGLang's log-prob triples), so at the default threshold
the collector ran every few turns, and its full passes walked every object of the process (the
trainer's: modules, JAX, the model's Python objects), a few to tens of milliseconds each: about 0.9
ms of a 3.5 ms turn with 256 trajectories in flight (benchmarks/host_rollout.py). Reference
counting frees everything as before; only cycles wait longer (among the frozen objects, until the
rollout ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import AsyncIterator, Iterator, Sequence

from rstar_jax.rollout.loop import run_trajectory
from rstar_jax.rollout.trajectory import Trajectory


def trajectory_runner(generator, tokenizer, executor, *, config, scorer, template=None, scheduler=None):
    """The `run_one` an Orchestrator needs: `run_trajectory` with everything but the prompt bound."""

    async def run_one(question: str, gold: str, group_id: int, sample_index: int) -> Trajectory:
        return await run_trajectory(generator, tokenizer, executor, question, gold, config=config, scorer=scorer,
                                    template=template, scheduler=scheduler, group_id=group_id,
                                    sample_index=sample_index)

    return run_one


GC_YOUNG_THRESHOLD = 20_000  # container allocations between the collector's youngest passes, in a rollout
_freezes = 0  # orchestrators with trajectories running under gc_frozen
_thresholds: tuple[int, ...] = ()  # the collector's thresholds before the first of them


@contextlib.contextmanager
def gc_frozen(enabled: bool = True) -> Iterator[None]:
    """Within: the objects that existed on entry stay out of the cyclic collector's passes, and its
    youngest pass runs every GC_YOUNG_THRESHOLD allocations at most (nested and concurrent uses share
    one setting, undone when the last one leaves)."""
    global _freezes, _thresholds
    if not enabled:
        yield
        return
    if _freezes == 0:
        gc.freeze()
        _thresholds = gc.get_threshold()
        if 0 < _thresholds[0] < GC_YOUNG_THRESHOLD:  # 0: the collector is off; leave it so
            gc.set_threshold(GC_YOUNG_THRESHOLD, *_thresholds[1:])
    _freezes += 1
    try:
        yield
    finally:
        _freezes -= 1
        if _freezes == 0:
            gc.set_threshold(*_thresholds)
            gc.unfreeze()


class Orchestrator:
    def __init__(self, run_one, *, max_concurrency: int = 64, freeze_gc: bool = True):
        """run_one(question, gold, group_id, sample_index) -> awaitable Trajectory. freeze_gc: run
        the trajectories under `gc_frozen` (see the module docstring)."""
        if max_concurrency < 1:
            raise ValueError(f"Orchestrator.max_concurrency must be >= 1, got {max_concurrency}")
        self.freeze_gc = freeze_gc
        self._run_one = run_one
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self.in_flight = 0
        self.peak_in_flight = 0

    async def _one(self, question, gold, group_id, index) -> Trajectory:
        async with self._semaphore:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                return await self._run_one(question, gold, group_id, index)
            finally:
                self.in_flight -= 1

    def groups(self, prompts: Sequence[tuple[str, str]], samples_per_prompt: int,
               first_group_id: int = 0) -> AsyncIterator[list[Trajectory]]:
        """Yields each prompt's trajectories (ordered by sample index) as soon as all have finished."""
        numbered = [(first_group_id + k, q, a) for k, (q, a) in enumerate(prompts)]
        return self.numbered_groups(numbered, samples_per_prompt)

    async def numbered_groups(self, prompts: Sequence[tuple[int, str, str]],
                              samples_per_prompt: int) -> AsyncIterator[list[Trajectory]]:
        """`groups` of (group_id, question, gold) triples, whatever their ids."""

        async def group(gid, question, gold):
            tasks = [asyncio.ensure_future(self._one(question, gold, gid, i)) for i in range(samples_per_prompt)]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        with gc_frozen(self.freeze_gc):
            pending = {asyncio.ensure_future(group(gid, q, a)) for gid, q, a in prompts}
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        yield list(task.result())
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def collect(self, prompts: Sequence[tuple[str, str]], samples_per_prompt: int,
                      first_group_id: int = 0) -> list[Trajectory]:
        out: list[Trajectory] = []
        async for g in self.groups(prompts, samples_per_prompt, first_group_id):
            out.extend(g)
        return sorted(out, key=lambda t: (t.group_id, t.sample_index))
