"""Rollout worker processes: a trainer process's share of a step spread over N processes.

`RolloutWorkers` runs N long-lived worker processes (`python -m rstar_jax.rollout.workers`, spawned,
never forked: the trainer has initialised JAX), each with its own event loop, SGLang clients,
scheduler, tool client and scorer (`rollout_runner`). The trainer's thread keeps only the
bookkeeping: it hands each worker its groups at a batch's start and reads finished groups back as
packed token arrays (`pack_trajectories`: flat int/float arrays and a small record per trajectory,
not JSON lists), so its Python thread stays free for JAX's dispatch. It offers the Orchestrator's
interface (`numbered_groups`, `groups`, `collect`), which the trainer calls either way.

Same trajectories as one process. A group goes to worker `group_id mod N` (deterministic, whatever
the timing), and every draw of a trajectory comes from its sampling seed, a function of (run seed,
group id, sample index) alone (`rstar_jax.rollout.loop.trajectory_seed`); the generators are
token in, token out. So which worker or which server runs a trajectory changes nothing in it (only
its timings: `tool_seconds`). Request ids are unique per server: each worker process (and each
replacement) draws its rids from its own range (`loop.set_rid_base`).

KV accounting is partitioned by generator: with at least N generators, worker i drives every N-th
of them from the i-th, and its KvScheduler is the only client admitting onto those, so its ledger
is that generator's whole ledger, exact and without any round trip. A global ledger in the trainer
process would put a cross-process round trip on every turn's admission (the critical path of each
turn) and tie the workers' event loops back to the trainer's thread, the one they exist to free.
With fewer generators than workers every worker sees all of them, as several trainer processes
sharing servers do (`app.builders.generation_share`): each ledger counts its own turns and the
generator's reported usage (everyone's) is the floor under it, so together they overcommit by at
most what the others admitted since the last report, which the engine's admission and retraction
absorb. The cost of partitioning: a worker's trajectories fail over only among its own generators,
and a worker whose groups run long is not helped by the others' servers. Sandbox targets are shared
out the same way.

A worker that dies (killed, crashed) is detected by the end of its socket; a replacement starts
and reruns, from their seeds, the groups it had not returned, for every batch in progress. Groups
already returned are kept, and a group is taken once only (a late or repeated one is dropped), so
nothing is lost or duplicated. A group whose worker dies more than `max_retries` times fails the
batch. Workers exit when the trainer process goes away (their socket ends, or their parent changes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from typing import Any, AsyncIterator, Sequence

from rstar_jax.agent.reward import make_scorer
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import load_tokenizer
from rstar_jax.rollout import loop as rollout_loop
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.orchestrator import Orchestrator, trajectory_runner
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler
from rstar_jax.rollout.sglang import SGLangGenerator
from rstar_jax.rollout.trajectory import Trajectory, pack_trajectories, unpack_trajectories

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
RID_SPAN = 1 << 48  # rids per worker process: the top 16 bits of a 64-bit rid name the process


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds its rollout from: picklable and free of JAX. `for_worker` gives each
    worker its share of the generators and sandbox targets."""

    urls: tuple[str, ...]  # SGLang(-compatible) servers
    sandbox_targets: tuple[str, ...]
    loop: LoopConfig
    template: ChatTemplate
    tokenizer: tuple[str, str | None, str | None]  # `load_tokenizer`'s (kind, path, generation_config)
    sandbox_api: str = "grpc"  # "grpc" (SandboxClient) | "sandbox_fusion"
    verify_via: str = "sandbox"  # `make_scorer`'s mode
    verify_timeout_s: float = 10.0
    scheduler: str = "kv"  # "kv" | "round_robin"
    kv_scheduler: dict = dataclasses.field(default_factory=dict)  # KvScheduler's keyword arguments
    generator: dict = dataclasses.field(default_factory=dict)  # SGLangGenerator's keyword arguments
    max_concurrency: int = 64  # trajectories in flight per batch (the whole pool's; split over the workers)
    freeze_gc: bool = True

    def __post_init__(self):
        if not self.urls:
            raise ValueError("WorkerSpec.urls: rollout workers need SGLang(-compatible) server URLs")
        if self.max_concurrency < 1:
            raise ValueError(f"WorkerSpec.max_concurrency must be >= 1, got {self.max_concurrency}")

    def for_worker(self, index: int, count: int) -> "WorkerSpec":
        """Worker `index` of `count`'s share (see the module docstring): every `count`-th generator and
        sandbox target from the `index`-th where there are at least `count`, else all of them; its
        part of the concurrency."""
        return dataclasses.replace(self, urls=share(self.urls, index, count),
                                   sandbox_targets=share(self.sandbox_targets, index, count),
                                   max_concurrency=-(-self.max_concurrency // count))


def share(items: Sequence, index: int, count: int) -> tuple:
    """Every `count`-th of `items` from the `index`-th when there are at least `count`, else all."""
    return tuple(items[index::count]) if len(items) >= count else tuple(items)


def assign(group_id: int, count: int) -> int:
    """The worker that runs group `group_id`: fixed by the id alone."""
    return group_id % count


@contextlib.asynccontextmanager
async def rollout_runner(spec: WorkerSpec) -> AsyncIterator[Any]:
    """The `run_one` (see `trajectory_runner`) of a worker: the spec's generators behind its scheduler,
    its tool client and scorer, all on the running event loop and closed on exit."""
    tokenizer = load_tokenizer(*spec.tokenizer)
    if spec.sandbox_api == "sandbox_fusion":
        from sandbox_service.fusion_client import SandboxFusionExecutor

        client = SandboxFusionExecutor(list(spec.sandbox_targets))
    else:
        from sandbox_service.client import SandboxClient

        client = SandboxClient(list(spec.sandbox_targets))
    scorer = make_scorer(spec.verify_via, timeout_s=spec.verify_timeout_s, sandbox_client=client)
    generators = [SGLangGenerator(url, **spec.generator) for url in spec.urls]
    try:
        scheduler = (KvScheduler(generators, **spec.kv_scheduler) if spec.scheduler == "kv"
                     else RoundRobinScheduler(generators))
        yield trajectory_runner(None, tokenizer, client, config=spec.loop, scorer=scorer, template=spec.template,
                                scheduler=scheduler)
    finally:
        scorer.close()
        await client.close()
        for generator in generators:
            await generator.close()


# -- framing: an 8-byte length, then a pickle (numpy arrays travel as buffers) ----------------------

def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(payload)) + payload


async def _read(reader: asyncio.StreamReader) -> Any:
    """The next message; EOFError when the other end has closed (a partial message counts as closed)."""
    try:
        header = await reader.readexactly(_HEADER.size)
        return pickle.loads(await reader.readexactly(_HEADER.unpack(header)[0]))
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise EOFError from e


# -- the worker process ----------------------------------------------------------------------------

async def _serve(fd: int, parent: int) -> int:
    """Serves the trainer process on socket `fd` until it stops, closes or goes away; the exit status."""
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    lock = asyncio.Lock()

    async def send(message) -> None:
        async with lock:
            writer.write(_frame(message))
            await writer.drain()

    try:
        spec, rid_base = await _read(reader)
    except EOFError:
        return 0
    rollout_loop.set_rid_base(rid_base)
    batches: dict[int, asyncio.Task] = {}

    async def run_batch(run_one, batch_id: int, numbered, samples: int) -> None:
        orchestrator = Orchestrator(run_one, max_concurrency=spec.max_concurrency, freeze_gc=spec.freeze_gc)
        try:
            async with contextlib.aclosing(orchestrator.numbered_groups(numbered, samples)) as groups:
                async for group in groups:
                    arrays, meta = pack_trajectories(group)
                    await send(("group", batch_id, group[0].group_id, arrays, meta))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001  (reported to the trainer, which raises it)
            await send(("error", batch_id, traceback.format_exc()))
        finally:
            batches.pop(batch_id, None)

    async def orphaned() -> None:  # the trainer process is gone (its socket may be held elsewhere)
        while os.getppid() == parent:
            await asyncio.sleep(1.0)

    watchdog = asyncio.ensure_future(orphaned())
    try:
        async with rollout_runner(spec) as run_one:
            try:
                await send(("ready", os.getpid()))
                while True:
                    reading = asyncio.ensure_future(_read(reader))
                    await asyncio.wait({reading, watchdog}, return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():
                        reading.cancel()
                        return 0
                    try:
                        message = reading.result()
                    except EOFError:
                        return 0
                    if message[0] == "run":
                        _, batch_id, numbered, samples = message
                        batches[batch_id] = asyncio.ensure_future(run_batch(run_one, batch_id, numbered, samples))
                    elif message[0] == "cancel":
                        task = batches.pop(message[1], None)
                        if task is not None:
                            task.cancel()
                    elif message[0] == "stop":
                        return 0
            finally:  # trajectories still running are cancelled (their requests aborted) before the clients close
                running = list(batches.values())
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
    except Exception:  # noqa: BLE001  (building the rollout failed: the trainer reports it)
        with contextlib.suppress(Exception):
            await send(("failed", traceback.format_exc()))
        return 1
    finally:
        watchdog.cancel()
        writer.close()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A rollout worker process (started by RolloutWorkers).")
    p.add_argument("--fd", type=int, required=True, help="the socket to the trainer process")
    p.add_argument("--parent", type=int, required=True, help="the trainer process's pid")
    args = p.parse_args(argv)
    # A Ctrl-C reaches the whole process group: the trainer process handles it, and its workers end
    # when it closes their sockets.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="[rollout worker %(process)d] %(levelname)s %(message)s")
    sys.exit(asyncio.run(_serve(args.fd, args.parent)))


# -- the trainer's side ----------------------------------------------------------------------------

class WorkerError(RuntimeError):
    """A rollout worker could not start, failed a batch, or died too often."""


@dataclasses.dataclass
class _Worker:
    index: int
    incarnation: int
    process: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int = 0
    listener: asyncio.Task | None = None


@dataclasses.dataclass
class _Batch:
    samples: int
    prompts: dict[int, tuple[str, str]]  # group id -> (question, gold)
    pending: dict[int, set[int]]  # worker index -> group ids it has not returned
    events: asyncio.Queue
    deaths: dict[int, int] = dataclasses.field(default_factory=dict)  # group id -> its workers that died


class RolloutWorkers:
    """N rollout worker processes (see the module docstring). Use as `async with RolloutWorkers(spec, n)
    as pool:` (or `await pool.start()` ... `await pool.close()`); then as an Orchestrator."""

    def __init__(self, spec: WorkerSpec, count: int, *, max_retries: int = 2, start_timeout_s: float = 300.0):
        if count < 1:
            raise ValueError(f"RolloutWorkers: count must be >= 1, got {count}")
        self.spec, self.count = spec, count
        self.max_retries, self.start_timeout_s = max_retries, start_timeout_s
        self.restarts = 0  # workers replaced so far
        self._workers: list[_Worker | None] = [None] * count
        self._restarting: set[int] = set()
        self._incarnations = itertools.count(1)
        self._batch_ids = itertools.count()
        self._batches: dict[int, _Batch] = {}
        self._closing = False
        self._broken = ""  # why a worker could not be replaced: the pool runs no further batch
        self._replacing: set[asyncio.Task] = set()

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids, by worker index (0 while one is being replaced)."""
        return [w.pid if w is not None and w.index not in self._restarting else 0 for w in self._workers]

    def outstanding(self, index: int) -> set[int]:
        """The group ids worker `index` was given and has not returned, over the batches in progress."""
        return set().union(*(batch.pending[index] for batch in self._batches.values()))

    async def __aenter__(self) -> "RolloutWorkers":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> "RolloutWorkers":
        started = await asyncio.gather(*(self._spawn(i) for i in range(self.count)), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(self._end(w) for w in started if isinstance(w, _Worker)))
            raise failed[0]
        for worker in started:
            self._install(worker)
        return self

    async def _spawn(self, index: int) -> _Worker:
        """A worker process for slot `index`, ready (its rollout built) or a WorkerError."""
        ours, theirs = socket.socketpair()
        incarnation = next(self._incarnations)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rstar_jax.rollout.workers", "--fd", str(theirs.fileno()),
                "--parent", str(os.getpid()), pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        worker = _Worker(index, incarnation, process, reader, writer)
        writer.write(_frame((self.spec.for_worker(index, self.count), incarnation * RID_SPAN)))
        try:
            message = await asyncio.wait_for(_read(reader), self.start_timeout_s)
        except (EOFError, asyncio.TimeoutError) as e:
            await self._end(worker)
            why = "timed out" if isinstance(e, asyncio.TimeoutError) else f"exited with {process.returncode}"
            raise WorkerError(f"rollout worker {index} did not start: it {why} (its output is above)") from None
        if message[0] != "ready":
            await self._end(worker)
            raise WorkerError(f"rollout worker {index} could not build its rollout:\n{message[1]}")
        worker.pid = message[1]
        return worker

    def _install(self, worker: _Worker) -> None:
        self._workers[worker.index] = worker
        self._restarting.discard(worker.index)
        worker.listener = asyncio.ensure_future(self._listen(worker))

    async def _end(self, worker: _Worker, *, timeout_s: float = 10.0) -> None:
        worker.writer.close()
        try:
            await asyncio.wait_for(worker.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
            await worker.process.wait()

    async def _listen(self, worker: _Worker) -> None:
        while True:
            try:
                message = await _read(worker.reader)
            except EOFError:
                break
            except Exception as e:  # noqa: BLE001  (an unreadable message: the worker is replaced)
                log.warning("rollout worker %d sent an unreadable message (%s): replacing it", worker.index, e)
                break
            kind, batch_id = message[0], message[1]
            batch = self._batches.get(batch_id)
            if batch is None:
                continue  # a batch already closed
            if kind == "group":
                _, _, group_id, arrays, meta = message
                if group_id in batch.pending[worker.index]:  # taken once: a late or repeated one is dropped
                    batch.pending[worker.index].discard(group_id)
                    batch.events.put_nowait(("group", unpack_trajectories(arrays, meta)))
            elif kind == "error":
                batch.events.put_nowait(("error", f"rollout worker {worker.index} failed a batch:\n{message[2]}"))
        if not self._closing and self._workers[worker.index] is worker:
            task = asyncio.ensure_future(self._replace(worker))
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)

    async def _replace(self, dead: _Worker) -> None:
        """Starts a worker in `dead`'s place and gives it the groups `dead` had not returned."""
        self._restarting.add(dead.index)
        await self._end(dead, timeout_s=1.0)
        log.warning("rollout worker %d (pid %d) ended with %s; starting a replacement", dead.index, dead.pid,
                    dead.process.returncode)
        failed = []
        for batch in self._batches.values():
            for group_id in batch.pending[dead.index]:
                batch.deaths[group_id] = batch.deaths.get(group_id, 0) + 1
                if batch.deaths[group_id] > self.max_retries:
                    failed.append((batch, group_id))
        for batch, group_id in failed:
            batch.events.put_nowait(("error", f"group {group_id}: its rollout worker died {batch.deaths[group_id]} "
                                              f"times (max_retries {self.max_retries})"))
        try:
            worker = await self._spawn(dead.index)
        except WorkerError as e:
            self._broken = str(e)
            for batch in self._batches.values():
                batch.events.put_nowait(("error", str(e)))
            return
        if self._closing:
            await self._end(worker)
            return
        self.restarts += 1
        self._install(worker)
        for batch_id, batch in self._batches.items():  # no await from the install to here: none is missed
            self._send_run(worker, batch_id, batch)

    def _send_run(self, worker: _Worker, batch_id: int, batch: _Batch) -> None:
        group_ids = sorted(batch.pending[worker.index])
        if group_ids:
            numbered = [(g, *batch.prompts[g]) for g in group_ids]
            worker.writer.write(_frame(("run", batch_id, numbered, batch.samples)))

    async def numbered_groups(self, prompts: Sequence[tuple[int, str, str]],
                              samples_per_prompt: int) -> AsyncIterator[list[Trajectory]]:
        """The Orchestrator's `numbered_groups` over the workers: each group (ordered by sample index)
        as soon as its worker returns it. Closing the iterator cancels the groups still running."""
        if any(w is None for w in self._workers):
            raise RuntimeError("RolloutWorkers: start() the pool first")
        if self._broken:
            raise WorkerError(f"RolloutWorkers: a worker could not be replaced: {self._broken}")
        batch_id = next(self._batch_ids)
        batch = _Batch(samples_per_prompt, {g: (q, a) for g, q, a in prompts},
                       {i: set() for i in range(self.count)}, asyncio.Queue())
        if len(batch.prompts) != len(prompts):
            raise ValueError("RolloutWorkers.numbered_groups: group ids must be distinct")
        for g in batch.prompts:
            batch.pending[assign(g, self.count)].add(g)
        self._batches[batch_id] = batch
        try:
            for worker in self._workers:  # one being replaced gets its groups once it is up
                if worker.index not in self._restarting:
                    self._send_run(worker, batch_id, batch)
            remaining = len(prompts)
            while remaining:
                kind, value = await batch.events.get()
                if kind == "error":
                    raise WorkerError(value)
                remaining -= 1
                yield sorted(value, key=lambda t: t.sample_index)
        finally:
            del self._batches[batch_id]
            for worker in self._workers:
                if worker is not None and batch.pending[worker.index] and worker.index not in self._restarting:
                    with contextlib.suppress(Exception):
                        worker.writer.write(_frame(("cancel", batch_id)))

    def groups(self, prompts: Sequence[tuple[str, str]], samples_per_prompt: int,
               first_group_id: int = 0) -> AsyncIterator[list[Trajectory]]:
        return self.numbered_groups([(first_group_id + k, q, a) for k, (q, a) in enumerate(prompts)],
                                    samples_per_prompt)

    async def collect(self, prompts: Sequence[tuple[str, str]], samples_per_prompt: int,
                      first_group_id: int = 0) -> list[Trajectory]:
        out: list[Trajectory] = []
        async with contextlib.aclosing(self.groups(prompts, samples_per_prompt, first_group_id)) as groups:
            async for group in groups:
                out.extend(group)
        return sorted(out, key=lambda t: (t.group_id, t.sample_index))

    async def close(self) -> None:
        """Stops every worker (a stop message, then its exit; killed after a grace period)."""
        self._closing = True
        for task in list(self._replacing):
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        workers = [w for w in self._workers if w is not None]
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.writer.write(_frame(("stop",)))
        await asyncio.gather(*(self._end(w) for w in workers), return_exceptions=True)
        for worker in workers:
            if worker.listener is not None:
                worker.listener.cancel()
        await asyncio.gather(*(w.listener for w in workers if w.listener is not None), return_exceptions=True)
        self._workers = [None] * self.count


if __name__ == "__main__":
    main()
