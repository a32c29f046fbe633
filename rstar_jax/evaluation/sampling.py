"""k responses per question with the agentic loop, streamed into the sample store group by group.

Every question is one group of k trajectories whose group id is the question's ordinal, so its
seeded samples do not depend on what else runs or on which questions a resumed run still lacks.
"""

from __future__ import annotations

import asyncio
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence

from rstar_jax.evaluation.questions import EvalError, Question
from rstar_jax.evaluation.store import SampleStore
from rstar_jax.rollout.orchestrator import Orchestrator
from rstar_jax.rollout.records import trajectory_record


def pending_questions(questions: Sequence[Question], groups: Mapping[str, list[dict]],
                      samples_path: pathlib.Path) -> list[Question]:
    """The questions without a complete group on disk; stored groups must still match their rows."""
    known = {q.key: q for q in questions}
    for key, group in groups.items():
        q = known.get(key)
        if q is not None and (group[0].get("question"), group[0].get("gold_answer")) != (q.question, q.answer):
            raise EvalError(f"{samples_path}: the records of {key} hold another question or answer than the file "
                            f"now does; the file changed since these samples were drawn")
    return [q for q in questions if q.key not in groups]


async def sample_groups(run_one, questions: Sequence[Question], k: int, *, store: SampleStore,
                        decode: Callable[[list[int]], str], max_concurrency: int,
                        on_group: Callable[[int, list[dict]], None] | None = None) -> dict[str, list[dict]]:
    """Samples k trajectories per question with `run_one` (see `trajectory_runner`) and appends
    each finished group to `store` before the next is awaited; returns the records by question key.
    on_group(groups done, the group's records): progress reporting."""
    orchestrator = Orchestrator(run_one, max_concurrency=max_concurrency)
    # Enough groups in flight to keep every trajectory slot busy, without creating a task for each
    # of tens of thousands of problems up front.
    window = 2 * max(1, math.ceil(max_concurrency / k))
    queue = iter(questions)
    running: dict[asyncio.Future, Question] = {}
    done: dict[str, list[dict]] = {}

    def start_next() -> None:
        q = next(queue, None)
        if q is not None:
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
                done[q.key] = records
                if on_group is not None:
                    on_group(len(done), records)
                start_next()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return done
