"""Async client of the sandbox service: several endpoints, send-worker batching, bounded retries.

    async with SandboxClient(["10.0.0.5:50051", "10.0.0.6:50051"]) as client:
        r = await client.execute("print(1 + 1)")          # r.status == "ok", r.stdout == "2\\n"
        v = await client.verify(response_text, "42")       # v.correct

Calls to `execute` are gathered into batches (up to `batch_size` calls, or what arrives within
`batch_wait_ms` after the first), as rStar2's send workers do, and sent as one streaming ExecuteBatch
RPC whose results resolve each caller as soon as its own program finishes. `batch_size=1` sends unary
Execute RPCs instead. Endpoints are picked round robin or least loaded (fewest calls in flight from
this client). Transient failures — the server unreachable or restarting, a full queue
(RESOURCE_EXHAUSTED / "rejected"), a lost worker ("sandbox_error") — are retried with exponential
backoff up to `max_retries` times; executions have no effects outside their sandbox, so a retry is
safe. A call whose retries run out returns a result with that status and a message; it never
disappears silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
from typing import AsyncIterator, Iterable, Iterator, Mapping, Sequence

import grpc

from sandbox_service import selftest, status
from sandbox_service._pb import pb2, pb2_grpc
from sandbox_service.harness import ERROR_FORMATS

log = logging.getLogger("sandbox_service.client")

POLICIES = ("least_loaded", "round_robin")
_NOT_RETRYABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE}
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.enable_retries", 0)]


@dataclasses.dataclass(frozen=True)
class ExecResult:
    status: str  # one of sandbox_service.status.ALL
    exit_code: int  # negative: killed by that signal
    stdout: str  # decoded as UTF-8 with errors="replace"; raw bytes in stdout_bytes
    stderr: str
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    cpu_s: float = 0.0
    message: str = ""  # why, for rejected / sandbox_error
    attempts: int = 1
    target: str = ""
    index: int = -1  # position in the input of execute_batch / execute_many
    worker: str = ""  # the server's worker that ran it ("lean0", "sci1", ...)

    @property
    def ok(self) -> bool:
        return self.status == status.OK


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    correct: bool
    status: str  # "ok" when the comparison finished, else why not (timeout, runtime_error, ...)
    extracted: str | None
    duration_s: float = 0.0
    message: str = ""


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """One program and its per-call options (None: the client's default, else the server's); the
    options are those of `SandboxClient.execute`."""

    code: str
    stdin: str = ""
    timeout_s: float | None = None
    memory_mb: int | None = None
    stream_cap_chars: int | None = None
    error_format: str | None = None
    cold_imports: bool | None = None
    memory_address_space: bool | None = None

    def options(self) -> dict:
        return {name: getattr(self, name) for name in OPTIONS}


# Per-call options of `execute` beyond code and stdin (ExecuteRequest's fields of the same names).
OPTIONS = ("timeout_s", "memory_mb", "stream_cap_chars", "error_format", "cold_imports", "memory_address_space")


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    target: str
    isolation_level: str
    isolation_features: dict
    isolation_warnings: list
    workers: int
    workers_alive: int
    slots_per_worker: int
    capacity: int
    queue_depth: int
    in_flight: int
    max_queue: int
    counters: dict
    default_timeout_s: float
    default_memory_mb: int
    output_limit_bytes: int
    version: str
    uptime_s: float
    import_checks: tuple = ()  # selftest.ImportCheck of the start-up self-test (servers from 1.2)
    interpreter: str = ""

    def self_test_failures(self, required=()) -> list[str]:
        """Why tool code on this server cannot import what it needs: each failed check of the start-up
        self-test, and each `required` module it did not check (the server was started without
        `--preimport` for it). Empty: usable, or a server older than 1.2, which has no self-test."""
        if not self.import_checks:
            return []
        problems = selftest.failures(self.import_checks, self.interpreter)
        checked = {c.module for c in self.import_checks}
        problems += [f"its self-test did not check {m}: start it with --preimport {m}" for m in required
                     if m not in checked]
        return problems

    def describe(self) -> str:
        """One line: the isolation in force and what tool code can import."""
        imports = (f"tool code imports {selftest.summary(self.import_checks)} (cold and pre-imported)"
                   if self.import_checks else f"no import self-test (server version {self.version or '?'})")
        return f"{self.target}: isolation {self.isolation_level}; {imports}"


class _Endpoint:
    def __init__(self, target: str):
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.stub = pb2_grpc.SandboxStub(self.channel)
        self.in_flight = 0
        self.down_until = 0.0


@dataclasses.dataclass
class _Pending:
    request: pb2.ExecuteRequest
    future: asyncio.Future
    attempts: int = 0
    last_status: str = status.SANDBOX_ERROR
    last_message: str = ""


def _as_request(item) -> ExecRequest:
    if isinstance(item, ExecRequest):
        return item
    if isinstance(item, str):
        return ExecRequest(item)
    if isinstance(item, tuple):
        return ExecRequest(*item)
    if isinstance(item, Mapping):
        return ExecRequest(**item)
    raise TypeError(f"batch request must be ExecRequest, str, tuple or mapping; got {type(item).__name__}")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def pick_endpoint(endpoints: list, turn: Iterator[int], *, round_robin: bool = False):
    """The endpoint with the fewest calls in flight (`in_flight`), ties taken in turn, among those
    not marked down (`down_until` passed; all of them when every one is down)."""
    now = time.monotonic()
    up = [e for e in endpoints if e.down_until <= now] or endpoints
    start = next(turn) % len(up)
    if round_robin:
        return up[start]
    return min(up[start:] + up[:start], key=lambda e: e.in_flight)


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Exponential backoff with jitter (half to all of base * 2^attempt, capped)."""
    return min(cap_s, base_s * (2 ** attempt)) * (0.5 + random.random() / 2)


class SandboxClient:
    def __init__(self, targets: str | Sequence[str], *, policy: str = "least_loaded", timeout_s: float | None = None,
                 memory_mb: int | None = None, stream_cap_chars: int | None = None, error_format: str | None = None,
                 cold_imports: bool | None = None, memory_address_space: bool | None = None,
                 max_retries: int = 10, backoff_s: float = 0.1,
                 max_backoff_s: float = 2.0, batch_size: int = 32, batch_wait_ms: float = 2.0,
                 max_inflight_batches: int = 64, rpc_timeout_s: float = 900.0):
        """targets: "host:port" or several. timeout_s, memory_mb, stream_cap_chars, error_format,
        cold_imports, memory_address_space: defaults sent with every call (see `execute`; None: the
        server's). rpc_timeout_s bounds one RPC attempt (queueing included)."""
        targets = [targets] if isinstance(targets, str) else list(targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"SandboxClient: targets must be non-empty 'host:port' strings; got {targets!r}")
        if policy not in POLICIES:
            raise ValueError(f"SandboxClient: policy must be one of {POLICIES}; got {policy!r}")
        if batch_size < 1 or batch_wait_ms < 0 or max_retries < 0 or max_inflight_batches < 1:
            raise ValueError("SandboxClient: batch_size >= 1, batch_wait_ms >= 0, max_retries >= 0 and "
                             "max_inflight_batches >= 1 are required")
        self.targets = targets
        self.policy = policy
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.stream_cap_chars, self.error_format, self.cold_imports = stream_cap_chars, error_format, cold_imports
        self.memory_address_space = memory_address_space
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.batch_size, self.batch_wait_s = batch_size, batch_wait_ms / 1000.0
        self.max_inflight_batches = max_inflight_batches
        self.rpc_timeout_s = rpc_timeout_s
        self._endpoints: list[_Endpoint] | None = None
        self._rr = itertools.count()
        self._ids = itertools.count()
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None
        self._batch_slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._pb_request(ExecRequest(""))  # bad defaults fail here, naming the option

    # -- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> "SandboxClient":
        self._ensure_started()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("SandboxClient is closed")
        if self._endpoints is None:
            self._endpoints = [_Endpoint(t) for t in self.targets]
            self._queue = asyncio.Queue()
            self._batch_slots = asyncio.Semaphore(self.max_inflight_batches)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks) + ([self._batcher] if self._batcher else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._queue is not None:
            while not self._queue.empty():
                p = self._queue.get_nowait()
                if not p.future.done():
                    p.future.set_exception(RuntimeError("SandboxClient closed before the call was sent"))
        for ep in self._endpoints or []:
            await ep.channel.close()

    # -- endpoint choice and retries -----------------------------------------------------------------
    def _pick(self) -> _Endpoint:
        return pick_endpoint(self._endpoints, self._rr, round_robin=self.policy == "round_robin")

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.backoff_s, self.max_backoff_s)

    def _pb_request(self, req: ExecRequest) -> pb2.ExecuteRequest:
        o = {name: value if value is not None else getattr(self, name) for name, value in req.options().items()}
        if not isinstance(req.code, str):
            raise TypeError(f"code must be a str; got {type(req.code).__name__}")
        if not isinstance(req.stdin, str):
            raise TypeError(f"stdin must be a str; got {type(req.stdin).__name__}")
        cap = o["stream_cap_chars"]
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"stream_cap_chars must be a non-negative int (0: the server's byte limit); got {cap!r}")
        if o["error_format"] is not None and o["error_format"] not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}; got {o['error_format']!r}")
        for flag in ("cold_imports", "memory_address_space"):
            if o[flag] is not None and not isinstance(o[flag], bool):
                raise TypeError(f"{flag} must be a bool; got {type(o[flag]).__name__}")
        return pb2.ExecuteRequest(request_id=str(next(self._ids)), code=req.code, stdin=req.stdin,
                                  timeout_s=float(o["timeout_s"] or 0.0), memory_mb=int(o["memory_mb"] or 0),
                                  stream_cap_chars=cap or 0, error_format=o["error_format"] or "",
                                  cold_imports=bool(o["cold_imports"]),
                                  memory_address_space=bool(o["memory_address_space"]))

    @staticmethod
    def _result(r, attempts: int, target: str) -> ExecResult:
        return ExecResult(status=r.status, exit_code=r.exit_code, stdout=_decode(r.stdout), stderr=_decode(r.stderr),
                          duration_s=r.duration_s, stdout_truncated=r.stdout_truncated,
                          stderr_truncated=r.stderr_truncated, stdout_bytes=r.stdout, stderr_bytes=r.stderr,
                          cpu_s=r.cpu_s, message=r.message, attempts=attempts, target=target, worker=r.worker)

    @staticmethod
    def _failure(code: str, message: str, attempts: int, target: str = "") -> ExecResult:
        return ExecResult(status=code, exit_code=-1, stdout="", stderr=message, duration_s=0.0, message=message,
                          attempts=attempts, target=target)

    # -- execute -------------------------------------------------------------------------------------
    async def execute(self, code: str, stdin: str = "", *, timeout_s: float | None = None,
                      memory_mb: int | None = None, stream_cap_chars: int | None = None,
                      error_format: str | None = None, cold_imports: bool | None = None,
                      memory_address_space: bool | None = None) -> ExecResult:
        """Runs `code` with `stdin`. The options override the client's defaults (None: keep them):
        timeout_s, memory_mb: the limits. stream_cap_chars > 0: stdout and stderr keep their first N
        characters and the call runs on (0: the server's byte limit, whose overrun kills it).
        error_format: "traceback" or "release" (the rStar2 release's one-line errors; see
        sandbox_service.harness). cold_imports: run where numpy/sympy are not pre-imported, so their
        import counts against the time limit. memory_address_space: memory_mb bounds the whole address
        space (an allocation beyond it raises MemoryError), not resident memory."""
        self._ensure_started()
        request = ExecRequest(code, stdin, timeout_s, memory_mb, stream_cap_chars, error_format, cold_imports,
                              memory_address_space)
        pb = self._pb_request(request)  # type errors surface here, in the caller
        if self.batch_size == 1:
            return await self._execute_unary(pb)
        pending = _Pending(pb, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())
        return await pending.future

    async def _execute_unary(self, request: pb2.ExecuteRequest) -> ExecResult:
        last_code, last_message, target = status.SANDBOX_ERROR, "", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            ep = self._pick()
            target = ep.target
            ep.in_flight += 1
            try:
                r = await ep.stub.Execute(request, timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                last_code, last_message = self._classify(e, ep)
                if e.code() in _NOT_RETRYABLE:
                    return self._failure(status.REJECTED, f"invalid request: {e.details()}", attempt + 1, target)
                continue
            finally:
                ep.in_flight -= 1
            if r.retryable and r.status in (status.REJECTED, status.SANDBOX_ERROR):
                last_code, last_message = r.status, r.message
                continue
            return self._result(r, attempt + 1, target)
        return self._failure(last_code, f"gave up after {self.max_retries + 1} attempts: {last_message}",
                             self.max_retries + 1, target)

    def _classify(self, e: grpc.aio.AioRpcError, ep: _Endpoint) -> tuple[str, str]:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return status.REJECTED, e.details() or "queue full"
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            ep.down_until = time.monotonic() + self.backoff_s
        return status.SANDBOX_ERROR, f"{e.code().name}: {e.details()}"

    async def _batch_loop(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            if self.batch_wait_s > 0 and self._queue.qsize() < self.batch_size - 1:
                await asyncio.sleep(self.batch_wait_s)
            while len(batch) < self.batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]  # callers that gave up
            if not batch:
                continue
            await self._batch_slots.acquire()
            task = asyncio.create_task(self._send_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._batch_slots.release()

    async def _send_batch(self, batch: list[_Pending]) -> None:
        ep = self._pick()
        by_id: dict[str, _Pending] = {}
        for p in batch:
            by_id[p.request.request_id] = p
            p.attempts += 1
        ep.in_flight += len(batch)
        retry: list[_Pending] = []
        try:
            async for r in self._results(ep, [p.request for p in batch]):
                p = by_id.pop(r.request_id, None)
                if p is None:
                    continue
                ep.in_flight -= 1
                if r.retryable and r.status in (status.REJECTED, status.SANDBOX_ERROR):
                    p.last_status, p.last_message = r.status, r.message
                    retry.append(p)
                elif not p.future.done():
                    p.future.set_result(self._result(r, p.attempts, ep.target))
        except grpc.aio.AioRpcError as e:
            code, message = self._classify(e, ep)
            for p in by_id.values():
                p.last_status, p.last_message = code, message
                if e.code() in _NOT_RETRYABLE and not p.future.done():
                    p.future.set_result(self._failure(status.REJECTED, f"invalid request: {e.details()}", p.attempts,
                                                      ep.target))
        finally:
            ep.in_flight -= len(by_id)
        for p in by_id.values():  # no result came back for these
            if not p.future.done():
                p.last_message = p.last_message or "the result stream ended without this call's result"
                retry.append(p)
        for p in retry:
            if p.future.done():
                continue
            if p.attempts > self.max_retries:
                message = f"gave up after {p.attempts} attempts: {p.last_message}"
                p.future.set_result(self._failure(p.last_status, message, p.attempts, ep.target))
                continue
            task = asyncio.create_task(self._requeue(p, self._backoff(p.attempts - 1)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _results(self, ep: _Endpoint, requests: list) -> AsyncIterator:
        # A lone call goes unary: a one-item result stream costs about 1.7x its client CPU, and at a
        # rollout's arrival rate most batches hold one call.
        if len(requests) == 1:
            yield await ep.stub.Execute(requests[0], timeout=self.rpc_timeout_s)
            return
        async for r in ep.stub.ExecuteBatch(pb2.ExecuteBatchRequest(requests=requests), timeout=self.rpc_timeout_s):
            yield r

    async def _requeue(self, p: _Pending, delay: float) -> None:
        await asyncio.sleep(delay)
        self._queue.put_nowait(p)
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())

    async def execute_batch(self, requests: Iterable) -> AsyncIterator[ExecResult]:
        """Yields results in completion order; each carries `index`, its position in `requests`.
        Items: ExecRequest, a code string, a (code, stdin) tuple or a mapping of ExecRequest fields."""
        reqs = [_as_request(r) for r in requests]

        async def one(i: int, r: ExecRequest) -> ExecResult:
            res = await self.execute(r.code, r.stdin, **r.options())
            return dataclasses.replace(res, index=i)

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(reqs)]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    async def execute_many(self, requests: Iterable) -> list[ExecResult]:
        """All results, in input order."""
        reqs = [_as_request(r) for r in requests]
        results = await asyncio.gather(*(self.execute(r.code, r.stdin, **r.options()) for r in reqs))
        return [dataclasses.replace(r, index=i) for i, r in enumerate(results)]

    # -- verify and info -----------------------------------------------------------------------------
    async def verify(self, response_text: str, gold_answer: str, *, timeout_s: float | None = None) -> VerifyResult:
        """Extracts the final answer of `response_text` and compares it with `gold_answer` on the
        server, under a hard deadline (timeout_s; None: the server's default)."""
        self._ensure_started()
        if not isinstance(response_text, str) or not isinstance(gold_answer, str):
            raise TypeError("verify: response_text and gold_answer must be str")
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            ep = self._pick()
            ep.in_flight += 1
            try:
                r = await ep.stub.Verify(pb2.VerifyRequest(request_id=str(next(self._ids)), response_text=response_text,
                                                           gold_answer=gold_answer, timeout_s=float(timeout_s or 0.0)),
                                         timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
                self._classify(e, ep)
                if e.code() in _NOT_RETRYABLE:
                    return VerifyResult(False, status.REJECTED, None, message=last)
                continue
            finally:
                ep.in_flight -= 1
            if r.status == status.SANDBOX_ERROR:
                last = r.message
                continue
            return VerifyResult(correct=r.correct, status=r.status, extracted=r.extracted if r.has_extracted else None,
                                duration_s=r.duration_s, message=r.message)
        return VerifyResult(False, status.SANDBOX_ERROR, None, message=f"gave up: {last}")

    async def info(self, target: str | None = None) -> ServerInfo:
        """Isolation level, workers, queue depth and capacity of one endpoint (default: the first)."""
        self._ensure_started()
        ep = next((e for e in self._endpoints if e.target == target), None) if target else self._endpoints[0]
        if ep is None:
            raise ValueError(f"info: unknown target {target!r}; known: {self.targets}")
        r = await ep.stub.Info(pb2.InfoRequest(), timeout=30)
        return ServerInfo(target=ep.target, isolation_level=r.isolation_level,
                          isolation_features=dict(r.isolation_features), isolation_warnings=list(r.isolation_warnings),
                          workers=r.workers, workers_alive=r.workers_alive, slots_per_worker=r.slots_per_worker,
                          capacity=r.capacity, queue_depth=r.queue_depth, in_flight=r.in_flight, max_queue=r.max_queue,
                          counters=dict(r.counters), default_timeout_s=r.default_timeout_s,
                          default_memory_mb=r.default_memory_mb, output_limit_bytes=r.output_limit_bytes,
                          version=r.version, uptime_s=r.uptime_s, interpreter=r.interpreter,
                          import_checks=tuple(selftest.ImportCheck(c.module, c.mode, c.ok, c.version, c.error, c.origin)
                                              for c in r.import_checks))

    ready_probe = "Info"  # what `ready` asks, for messages about servers that do not answer

    async def ready(self, target: str,
                    modules: Sequence[str] = selftest.STANDARD_MODULES) -> tuple[str, list[str]] | None:
        """None while `target` does not answer `Info`; then a line on its isolation and what tool code
        imports there (its start-up self-test), and one problem per module of `modules` it cannot import."""
        try:
            info = await self.info(target)
        except Exception:  # noqa: BLE001  (any failure to answer: not ready yet)
            return None
        return info.describe(), info.self_test_failures(required=modules)

    async def info_all(self) -> list[ServerInfo]:
        self._ensure_started()
        return list(await asyncio.gather(*(self.info(e.target) for e in self._endpoints)))
