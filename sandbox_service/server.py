"""gRPC (grpc.aio) front end and the supervised worker pool.

The server process never forks: workers are started with exec (`python -m sandbox_service.workers`)
and talk over a Unix socket pair. Two flavours of workers run side by side: "lean" (standard library
pre-imported, cheapest fork) and "sci" (numpy, sympy, scipy, math-verify pre-imported); a call goes to
"sci" when its code names one of those libraries (unless it asks for `cold_imports`: its imports
then count against its time limit), and Verify always does.

Admission is bounded: at most capacity + max_queue calls are admitted; beyond that Execute answers
RESOURCE_EXHAUSTED at once and ExecuteBatch items come back "rejected" (retryable). A worker that dies
or hangs is killed and restarted; its in-flight calls are re-dispatched once (executions have no
effects outside their sandbox), and come back as sandbox_error if the retry is lost too.

With `ServerOptions.http_port`, SandboxFusion's HTTP API (sandbox_service.fusion_api) is served beside
gRPC, through the same validation (`exec_args`), admission and pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import os
import random
import re
import secrets
import signal
import socket
import sys
import time

import grpc

from sandbox_service import isolation, selftest, status
from sandbox_service._pb import pb2, pb2_grpc
from sandbox_service.framing import encode, read_frame
from sandbox_service.harness import ERROR_FORMATS
from sandbox_service.status import MAX_STREAM_CAP_CHARS

log = logging.getLogger("sandbox_service")

# 1.1: ExecuteRequest.stream_cap_chars, error_format, cold_imports (a 1.0 server ignores them);
# 1.2: InfoReply.import_checks, interpreter (the start-up self-test)
VERSION = "1.2"
_SCI_MODULES = ("numpy", "sympy", "scipy", "mpmath", "networkx", "math_verify")  # a call naming one runs on "sci"
_LEVEL_ORDER = {"minimal": 0, "partial": 1, "full": 2}
UID_STRIDE = 4096  # uids reserved per server when uid_base is derived from the pid
HANG_SLACK_S = 10.0  # a worker that has not answered this long after a call's deadline is hung


@dataclasses.dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    workers: int = 2  # per flavour
    slots: int = 4  # concurrent calls per worker
    timeout_s: float = 10.0
    max_timeout_s: float = 300.0
    memory_mb: int = 1024
    max_memory_mb: int = 32768
    max_queue: int = 4096
    output_limit_bytes: int = 64 << 10
    max_code_bytes: int = 1 << 20
    max_stdin_bytes: int = 1 << 20
    verify_timeout_s: float = 10.0
    scratch_mb: int = 64
    pids_max: int = 64
    isolation: str = "auto"  # "auto" | "minimal" (rlimits only; for tests of the degraded path)
    # Slot uids start here; uid_base - 1 is the workers' root in their user namespace. None: a range
    # derived from the server's pid, so that servers sharing a host do not share uids (RLIMIT_NPROC
    # counts per uid).
    uid_base: int | None = None
    # Also serve SandboxFusion's HTTP API (sandbox_service.fusion_api) on this port of `host`; 0: any
    # free port; None: gRPC only.
    http_port: int | None = None
    # Modules the "sci" workers pre-import beside numpy, sympy and mpmath; the start-up self-test
    # checks that tool code imports each, and a call naming one runs on "sci".
    preimports: tuple[str, ...] = ()
    # For experiments on noisy environments (off by default): this share of executions is answered as a
    # wall-clock timeout without running, as a loaded fleet does (a worker_timeout in the release),
    # drawn from a generator seeded with `inject_seed`. Not retryable: the policy sees it.
    inject_timeout_rate: float = 0.0
    inject_seed: int = 0

    @functools.cached_property
    def sci_names(self) -> re.Pattern:
        names = sorted({*_SCI_MODULES, *(m.split(".")[0] for m in self.preimports)})
        return re.compile(r"\b(?:" + "|".join(map(re.escape, names)) + r")\b")

    def validate(self) -> None:
        checks = [("workers", self.workers >= 1), ("slots", self.slots >= 1),
                  ("timeout_s", 0 < self.timeout_s <= self.max_timeout_s),
                  ("memory_mb", 16 <= self.memory_mb <= self.max_memory_mb), ("max_queue", self.max_queue >= 0),
                  ("output_limit_bytes", 1 <= self.output_limit_bytes <= 16 << 20),
                  ("isolation", self.isolation in ("auto", "minimal")),
                  ("verify_timeout_s", 0 < self.verify_timeout_s <= self.max_timeout_s),
                  ("scratch_mb", self.scratch_mb >= 1), ("pids_max", self.pids_max >= 4),
                  ("uid_base", self.uid_base is None or 1000 < self.uid_base < 2**31 - 2 * self.workers * self.slots),
                  ("slots", self.uid_base is not None or 2 * self.workers * self.slots < UID_STRIDE),
                  ("http_port", self.http_port is None or (isinstance(self.http_port, int)
                                                           and 0 <= self.http_port <= 65535)),
                  ("inject_timeout_rate", 0 <= self.inject_timeout_rate < 1)]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise ValueError(f"invalid server options: {', '.join(f'{b}={getattr(self, b)!r}' for b in bad)}")
        selftest.check_module_names(self.preimports, "preimports")


class WorkerLost(Exception):
    def __init__(self, message: str, *, ran: bool = True):
        super().__init__(message)
        self.ran = ran


@dataclasses.dataclass
class Job:
    kind: str  # "exec" | "verify"
    flavour: str
    blobs: list[bytes]
    timeout_s: float
    memory_mb: int
    future: asyncio.Future
    attempts: int = 0
    options: dict = dataclasses.field(default_factory=dict)  # per call: stream cap, error format, memory kind


class WorkerHandle:
    """One worker process: start, framed request/response, death detection."""

    def __init__(self, pool: "Pool", flavour: str, index: int):
        self.pool, self.flavour, self.index = pool, flavour, index
        self.name = f"{flavour}{index}"
        self.global_index = index + (pool.options.workers if flavour == "sci" else 0)  # distinct slot uids
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.alive = False
        self.ready = asyncio.Event()
        self.report: dict | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.restarts = 0
        self._reader_task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        o = self.pool.options
        parent, child = socket.socketpair()
        cmd = [sys.executable, "-m", "sandbox_service.workers", "--fd", str(child.fileno()), "--index", str(self.index),
               "--flavour", self.flavour, "--slots", str(o.slots), "--instance", self.pool.instance,
               "--isolation", o.isolation, "--uid-base", str(o.uid_base + self.global_index * o.slots),
               "--ns-root-uid", str(o.uid_base - 1), "--pids-max", str(o.pids_max),
               "--scratch-mb", str(o.scratch_mb), "--output-limit", str(o.output_limit_bytes)]
        if self.flavour == "sci":
            cmd += [arg for name in o.preimports for arg in ("--preimport", name)]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *cmd, pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, env=env)
        finally:
            child.close()
        reader, self.writer = await asyncio.open_unix_connection(sock=parent)
        try:
            header, _ = await asyncio.wait_for(read_frame(reader), timeout=120)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            await self._kill_process()
            raise RuntimeError(f"worker {self.name} did not start: {e!r}") from e
        if header.get("type") != "ready":
            await self._kill_process()
            raise RuntimeError(f"worker {self.name} sent {header!r} instead of ready")
        self.report = header["isolation"]
        self.alive = True
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        self.ready.set()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, blobs = await read_frame(reader)
                fut = self.pending.pop(header.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result((header, blobs))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            if not self._stopping:
                log.error("worker %s lost: %r", self.name, e)
        except asyncio.CancelledError:
            pass
        finally:
            self._on_lost("the worker process died")

    def _on_lost(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.ready.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(WorkerLost(f"worker {self.name}: {why}"))
        self.pending.clear()
        if not self._stopping:
            self.pool.counters["worker_restarts"] += 1
            asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        await self._kill_process()
        delay = 0.1
        while not self._stopping:
            try:
                await self.start()
                self.restarts += 1
                log.warning("worker %s restarted", self.name)
                return
            except Exception as e:  # noqa: BLE001 - keep trying: the pool must heal itself
                log.error("restarting worker %s failed: %s; retrying in %.1fs", self.name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def call(self, job: Job) -> tuple[dict, list[bytes]]:
        if not self.alive:
            raise WorkerLost(f"worker {self.name} is not running", ran=False)
        call_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[call_id] = fut
        self.writer.write(encode({"type": "call", "id": call_id, "kind": job.kind, "timeout_s": job.timeout_s,
                                  "memory_mb": job.memory_mb, **job.options}, job.blobs))
        watchdog = asyncio.get_running_loop().call_later(job.timeout_s + HANG_SLACK_S, self._on_hang, call_id)
        try:
            return await fut
        finally:
            watchdog.cancel()

    def _on_hang(self, call_id: int) -> None:
        """A call overran its deadline by HANG_SLACK_S: the worker is stuck; kill it (its calls are
        then failed over by `_on_lost`)."""
        if call_id in self.pending and self.proc is not None and self.proc.returncode is None:
            log.error("worker %s did not answer call %d in time; killing it", self.name, call_id)
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    async def _kill_process(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await self.proc.wait()
        if self.writer is not None:
            self.writer.close()

    async def stop(self) -> None:
        """Closes the control socket (the zygote kills its calls, removes its cgroups and exits)."""
        self._stopping = True
        if self._reader_task:
            self._reader_task.cancel()
        if self.writer is not None:
            self.writer.close()
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                await self._kill_process()
        self._on_lost("stopped")


class Pool:
    """Workers of both flavours, a priority queue per flavour, and bounded admission."""

    def __init__(self, options: ServerOptions):
        if options.uid_base is None:
            options = dataclasses.replace(options, uid_base=100_000_000 + (os.getpid() % 400_000) * UID_STRIDE)
        self.options = options
        self.instance = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.workers = {f: [WorkerHandle(self, f, i) for i in range(options.workers)] for f in ("lean", "sci")}
        self.queues: dict[str, asyncio.PriorityQueue] = {}
        self.seq = itertools.count()
        self.in_flight = 0
        self.counters: dict[str, int] = {s: 0 for s in status.ALL}
        self.counters.update(worker_restarts=0, retried=0, verify_calls=0, injected_timeouts=0)
        self._injector = random.Random(options.inject_seed)
        self._tasks: list[asyncio.Task] = []
        self.import_checks: list[selftest.ImportCheck] = []  # the start-up self-test's

    @property
    def capacity(self) -> int:
        return 2 * self.options.workers * self.options.slots

    def all_workers(self) -> list[WorkerHandle]:
        return [w for ws in self.workers.values() for w in ws]

    async def start(self) -> None:
        self.queues = {f: asyncio.PriorityQueue() for f in self.workers}
        isolation.remove_stale_instances()
        await asyncio.gather(*(w.start() for w in self.all_workers()))
        for w in self.all_workers():
            for _ in range(self.options.slots):
                self._tasks.append(asyncio.create_task(self._slot_loop(w)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*(w.stop() for w in self.all_workers()), return_exceptions=True)
        for _ in range(50):  # slot groups disappear once their last process is reaped
            isolation.remove_instance_cgroups(self.instance)
            roots = (f"{isolation.CGROUP_V1}/memory", f"{isolation.CGROUP_V1}/pids", *isolation.CGROUP_V2_CANDIDATES)
            if not any(os.path.isdir(f"{r}/sandbox_service/{self.instance}") for r in roots):
                break
            await asyncio.sleep(0.02)

    async def self_test(self) -> list[selftest.ImportCheck]:
        """Imports every expected module in one call per mode (see sandbox_service.selftest); kept in
        `import_checks` for Info."""
        modules = (*selftest.STANDARD_MODULES, *self.options.preimports)
        code = selftest.probe_code(modules).encode()
        timeout = min(selftest.TIMEOUT_S, self.options.max_timeout_s)
        options = {"stream_cap_chars": 0, "error_format": "", "memory_address_space": False}

        async def one(mode: str, flavour: str) -> list[selftest.ImportCheck]:
            self.in_flight += 1  # admitted: run() releases it
            header, blobs = await self.run("exec", flavour, [code, b""], timeout, self.options.memory_mb, options)
            failure = (f"the self-test call ended with status {header['status']}: "
                       f"{(header.get('message') or blobs[1].decode(errors='replace')).strip()[-300:]}")
            return selftest.parse_probe(blobs[0].decode(errors="replace"), modules, mode, failure=failure, locate=True)

        cold, preimported = await asyncio.gather(one("cold", "lean"), one("preimported", "sci"))
        self.import_checks = cold + preimported
        return self.import_checks

    def isolation_summary(self) -> dict:
        reports = [w.report for w in self.all_workers() if w.report]
        if not reports:
            return {"level": "minimal", "features": {}, "warnings": ["no worker has started"]}
        level = min((r["level"] for r in reports), key=_LEVEL_ORDER.__getitem__)
        features = {k: all(r["features"].get(k, False) for r in reports) for k in reports[0]["features"]}
        warnings = sorted({w for r in reports for w in r["warnings"]})
        return {"level": level, "features": features, "warnings": warnings}

    def queue_depth(self) -> int:
        return sum(q.qsize() for q in self.queues.values())

    def full_message(self) -> str:
        return (f"sandbox queue full: {self.in_flight} calls admitted, limit "
                f"{self.capacity + self.options.max_queue}; retry later")

    def try_admit(self) -> bool:
        if self.in_flight >= self.capacity + self.options.max_queue:
            self.counters[status.REJECTED] += 1
            return False
        self.in_flight += 1
        return True

    async def run(self, kind: str, flavour: str, blobs: list[bytes], timeout_s: float, memory_mb: int,
                  options: dict | None = None, *, injectable: bool = False):
        """Runs an admitted job; returns the worker's (header, blobs). Releases the admission.
        `injectable`: a client's execution, which `inject_timeout_rate` may answer without running."""
        job = Job(kind, flavour, blobs, timeout_s, memory_mb, asyncio.get_running_loop().create_future(),
                  options=options or {})
        try:
            if injectable and self.options.inject_timeout_rate and \
                    self._injector.random() < self.options.inject_timeout_rate:
                self.counters["injected_timeouts"] += 1
                return _injected_timeout(timeout_s, job.options.get("error_format", ""))
            self.queues[flavour].put_nowait((1, next(self.seq), job))
            return await job.future
        finally:
            self.in_flight -= 1
            if not job.future.done():
                job.future.cancel()  # the caller went away: a queued job is skipped

    async def _slot_loop(self, worker: WorkerHandle) -> None:
        queue = self.queues[worker.flavour]
        while True:
            await worker.ready.wait()
            _, _, job = await queue.get()
            if job.future.done():
                continue
            if not worker.alive:
                queue.put_nowait((0, next(self.seq), job))
                continue
            try:
                result = await worker.call(job)
            except WorkerLost as e:
                if e.ran:
                    job.attempts += 1
                if job.attempts < 2:
                    self.counters["retried"] += int(e.ran)
                    queue.put_nowait((0, next(self.seq), job))
                elif not job.future.done():
                    job.future.set_result(_error_header(f"{e}; the call was lost twice"))
                continue
            if not job.future.done():
                result[0]["worker"] = worker.name
                job.future.set_result(result)


def _injected_timeout(timeout_s: float, error_format: str) -> tuple[dict, list[bytes]]:
    """What a call killed at its wall-clock limit reports (calls.call_result), for a call not run."""
    note = b"" if error_format == "release" else f"\n{status.TIMEOUT_NOTE.format(timeout_s)}\n".encode()
    return ({"status": status.TIMEOUT, "exit_code": -signal.SIGKILL, "duration_s": timeout_s, "cpu_s": 0.0,
             "stdout_truncated": False, "stderr_truncated": False,
             "message": "injected (--inject-timeout-rate): not run"}, [b"", note])


def _error_header(message: str) -> tuple[dict, list[bytes]]:
    return ({"status": status.SANDBOX_ERROR, "exit_code": -1, "duration_s": 0.0, "cpu_s": 0.0,
             "stdout_truncated": False, "stderr_truncated": False, "message": message, "retryable": True}, [b"", b""])


def call_limits(o: ServerOptions, timeout_s: float, memory_mb: int, default_timeout: float, *,
                names: dict | None = None) -> tuple[float, int]:
    """(timeout, memory) of a call; 0 asks for the default. A ValueError names the bad field, under the
    caller's own name for it where `names` maps "timeout_s" / "memory_mb" to one (another API's
    fields: their zero is not "the default", so that hint is left out)."""
    names = names or {}
    timeout = timeout_s or default_timeout
    if not (math.isfinite(timeout) and 0 < timeout <= o.max_timeout_s):
        hint = "" if "timeout_s" in names else f" (0 = default {default_timeout:g})"
        raise ValueError(f"{names.get('timeout_s', 'timeout_s')} must be in (0, {o.max_timeout_s:g}]{hint}; "
                         f"got {timeout_s!r}")
    memory = memory_mb or o.memory_mb
    if not 16 <= memory <= o.max_memory_mb:
        hint = "" if "memory_mb" in names else f" (0 = default {o.memory_mb})"
        raise ValueError(f"{names.get('memory_mb', 'memory_mb')} must be in [16, {o.max_memory_mb}]{hint}; "
                         f"got {memory_mb!r}")
    return timeout, memory


def exec_args(o: ServerOptions, code: str, stdin: str, *, timeout_s: float = 0.0, memory_mb: int = 0,
              stream_cap_chars: int = 0, error_format: str = "", cold_imports: bool = False,
              memory_address_space: bool = False,
              names: dict | None = None) -> tuple[list[bytes], float, int, str, dict]:
    """Validates one execution request of any front end (gRPC's ExecuteRequest fields, or another
    API's under `names`) and returns what `Pool.run("exec", ...)` takes: blobs [code, stdin], timeout,
    memory, flavour and the worker options. A ValueError names the bad field."""
    names = names or {}
    code_b, stdin_b = code.encode("utf-8", "surrogateescape"), stdin.encode("utf-8", "surrogateescape")
    if len(code_b) > o.max_code_bytes:
        raise ValueError(f"{names.get('code', 'code')} is {len(code_b)} bytes; the limit is {o.max_code_bytes}")
    if len(stdin_b) > o.max_stdin_bytes:
        raise ValueError(f"{names.get('stdin', 'stdin')} is {len(stdin_b)} bytes; the limit is {o.max_stdin_bytes}")
    timeout, memory = call_limits(o, timeout_s, memory_mb, o.timeout_s, names=names)
    if not 0 <= stream_cap_chars <= MAX_STREAM_CAP_CHARS:
        raise ValueError(f"stream_cap_chars must be in [0, {MAX_STREAM_CAP_CHARS}] (0 = the byte limit "
                         f"{o.output_limit_bytes}, which kills the call); got {stream_cap_chars}")
    if error_format not in ERROR_FORMATS:
        raise ValueError(f"error_format must be one of {ERROR_FORMATS}; got {error_format!r}")
    flavour = "sci" if o.sci_names.search(code) and not cold_imports else "lean"
    options = {"stream_cap_chars": int(stream_cap_chars), "error_format": error_format,
               "memory_address_space": bool(memory_address_space)}
    return [code_b, stdin_b], timeout, memory, flavour, options


class SandboxServicer(pb2_grpc.SandboxServicer):
    def __init__(self, pool: Pool):
        self.pool = pool
        self.options = pool.options
        self.started = time.monotonic()

    # -- validation ----------------------------------------------------------------------------------
    def _limits(self, timeout_s: float, memory_mb: int, default_timeout: float) -> tuple[float, int]:
        return call_limits(self.options, timeout_s, memory_mb, default_timeout)

    def _exec_args(self, req) -> tuple[list[bytes], float, int, str, dict]:
        return exec_args(self.options, req.code, req.stdin, timeout_s=req.timeout_s, memory_mb=req.memory_mb,
                         stream_cap_chars=req.stream_cap_chars, error_format=req.error_format,
                         cold_imports=req.cold_imports, memory_address_space=req.memory_address_space)

    def _to_result(self, request_id: str, header: dict, blobs: list[bytes], worker: str = "") -> pb2.ExecuteResult:
        code = header["status"]
        self.pool.counters[code] = self.pool.counters.get(code, 0) + 1
        return pb2.ExecuteResult(
            request_id=request_id, status=code, exit_code=int(header["exit_code"]), stdout=blobs[0], stderr=blobs[1],
            stdout_truncated=bool(header["stdout_truncated"]), stderr_truncated=bool(header["stderr_truncated"]),
            duration_s=float(header["duration_s"]), cpu_s=float(header["cpu_s"]), message=header.get("message", ""),
            retryable=code == status.SANDBOX_ERROR, worker=header.get("worker", worker))

    @staticmethod
    def _rejected(request_id: str, message: str, *, retryable: bool) -> pb2.ExecuteResult:
        return pb2.ExecuteResult(request_id=request_id, status=status.REJECTED, exit_code=-1, message=message,
                                 retryable=retryable)

    async def _execute_admitted(self, req) -> pb2.ExecuteResult:
        blobs, timeout, memory, flavour, options = self._exec_args(req)
        header, out = await self.pool.run("exec", flavour, blobs, timeout, memory, options, injectable=True)
        return self._to_result(req.request_id, header, out)

    # -- RPCs ----------------------------------------------------------------------------------------
    async def Execute(self, request, context):
        try:
            self._exec_args(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.pool.try_admit():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.pool.full_message())
        # try_admit counted this call; Pool.run releases it
        return await self._execute_admitted(request)

    async def ExecuteBatch(self, request, context):
        tasks = []
        for req in request.requests:
            try:
                self._exec_args(req)
            except ValueError as e:
                yield self._rejected(req.request_id, f"invalid request: {e}", retryable=False)
                continue
            if not self.pool.try_admit():
                yield self._rejected(req.request_id, self.pool.full_message(), retryable=True)
                continue
            tasks.append(asyncio.ensure_future(self._execute_admitted(req)))
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    async def Verify(self, request, context):
        o = self.options
        text = request.response_text.encode("utf-8", "surrogateescape")
        gold = request.gold_answer.encode("utf-8", "surrogateescape")
        if len(text) + len(gold) > o.max_code_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"response_text + gold_answer is "
                                f"{len(text) + len(gold)} bytes; the limit is {o.max_code_bytes}")
        try:
            timeout, memory = self._limits(request.timeout_s, 0, o.verify_timeout_s)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.pool.try_admit():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.pool.full_message())
        self.pool.counters["verify_calls"] += 1
        header, blobs = await self.pool.run("verify", "sci", [text, gold], timeout, memory)
        verdict = header.get("verify")
        code = header["status"]
        message = header.get("message", "") or (blobs[1].decode(errors="replace")[-2000:] if code != status.OK else "")
        if code == status.OK and verdict is None:
            code, message = status.RUNTIME_ERROR, "the verifier produced no verdict"
        extracted = verdict.get("extracted") if verdict else None
        return pb2.VerifyResult(request_id=request.request_id, correct=bool(verdict and verdict["correct"]),
                                status=code, has_extracted=extracted is not None, extracted=extracted or "",
                                duration_s=float(header["duration_s"]), message=message)

    async def Health(self, request, context):
        alive = sum(w.alive for w in self.pool.all_workers())
        level = self.pool.isolation_summary()["level"]
        return pb2.HealthReply(serving=alive > 0, isolation_level=level, workers_alive=alive)

    async def Info(self, request, context):
        summary = self.pool.isolation_summary()
        workers = self.pool.all_workers()
        return pb2.InfoReply(
            isolation_level=summary["level"], isolation_features=summary["features"],
            isolation_warnings=summary["warnings"],
            workers=len(workers), workers_alive=sum(w.alive for w in workers), slots_per_worker=self.options.slots,
            capacity=self.pool.capacity, queue_depth=self.pool.queue_depth(), in_flight=self.pool.in_flight,
            max_queue=self.options.max_queue, counters=self.pool.counters, default_timeout_s=self.options.timeout_s,
            default_memory_mb=self.options.memory_mb, output_limit_bytes=self.options.output_limit_bytes,
            version=VERSION, uptime_s=time.monotonic() - self.started,
            import_checks=[pb2.ImportCheck(**dataclasses.asdict(c)) for c in self.pool.import_checks],
            interpreter=sys.executable)
