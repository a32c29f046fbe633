"""Drivers for `benchmarks/sandbox_throughput.py --peer`: ours and peer sandboxes behind one interface,
and the hostile snippets whose containment the benchmark reports for each.

Peers are services already running (see the benchmark's --help); nothing here starts them:
- code-judge (0xWJ/code-judge, the rStar2 release's environment): `POST /run`, one request per call;
  and `POST /run/long-batch`, batched as the release's client batches (`CodeJudgeLongBatch`). Its
  limits are the server's settings (MAX_EXECUTION_TIME, MAX_MEMORY), not per request.
- SandboxFusion (bytedance/SandboxFusion): `POST /run_code`, with the limits in each request.

Peers get the snippet as is: not wrapped in the release's code template (rStar's code_judge_utils.py
`code_template_setup`, whose own imports would add to each peer call), while ours runs the release's
error format in its harness, so any such cost is on our side.

Every driver returns a `Reply` whose `outcome` is one of OUTCOMES, so that failures are counted the
same way for all: "timeout" (the sandbox's time limit), "error" (it ran and failed, or the service
answered with an error), "lost" (no result: the service dropped the call, or no answer came).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import textwrap
import urllib.parse

import aiohttp

from sandbox_service import status
from sandbox_service.client import SandboxClient

OUTCOMES = ("ok", "timeout", "error", "lost")
KINDS = ("code-judge", "fusion")
REQUEST_TIMEOUT_S = 120.0  # an HTTP call with no answer by then counts as lost


@dataclasses.dataclass(frozen=True)
class Reply:
    outcome: str  # one of OUTCOMES
    stdout: str = ""
    stderr: str = ""
    detail: str = ""  # the sandbox's own status or reason, for the report


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_mb: int


# -- ours ------------------------------------------------------------------------------------------

_OURS_OUTCOME = {status.OK: "ok", status.TIMEOUT: "timeout", status.REJECTED: "lost", status.SANDBOX_ERROR: "lost"}


class Ours:
    """Our gRPC sandbox through `SandboxClient`, each call with `options` (SandboxClient.execute's)."""

    def __init__(self, targets, *, batch_size: int, batch_wait_ms: float, options: dict, name: str = "ours"):
        self.name = name
        self.client = SandboxClient(targets, batch_size=batch_size, batch_wait_ms=batch_wait_ms, **options)

    async def __aenter__(self) -> "Ours":
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def execute(self, code: str) -> Reply:
        r = await self.client.execute(code)
        detail = r.status + (f": {r.message}" if r.message else "")
        return Reply(_OURS_OUTCOME.get(r.status, "error"), r.stdout, r.stderr, detail)


# -- HTTP peers ------------------------------------------------------------------------------------

class _Lost(Exception):
    """No usable answer came back (connection failure, no answer in time)."""


class _HttpError(Exception):
    """The service answered with an HTTP error status."""


class _Http:
    name = ""
    connections = 0  # aiohttp's connector limit; 0: none, so concurrency is the number of requests in flight
    timeout_s = REQUEST_TIMEOUT_S

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections),
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def _post(self, path: str, body: dict) -> dict:
        """The JSON answer; _Lost when none came; an HTTP error status raises _HttpError."""
        try:
            async with self.session.post(self.url + path, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise _HttpError(f"HTTP {resp.status}: {text[:200]}")
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            raise _Lost(f"{type(e).__name__}: {e}"[:200]) from e


def _code_judge_reply(res: dict) -> Reply:
    """One code-judge SubmissionResult. Its `reason`: queue_timeout (the item was dropped or never
    answered: lost), worker_timeout (the time limit), internal_error / invalid_input."""
    reason = res.get("reason") or ""
    out, err = res.get("stdout") or "", res.get("stderr") or ""
    if reason == "queue_timeout":
        return Reply("lost", out, err, reason)
    if reason == "worker_timeout":
        return Reply("timeout", out, err, reason)
    if reason:
        return Reply("error", out, err, reason)
    return Reply("ok" if res.get("run_success") else "error", out, err, "" if res.get("run_success") else "exit != 0")


class CodeJudgeRun(_Http):
    """code-judge's `POST /run`: one request per call, no retries."""

    name = "code-judge /run"

    async def execute(self, code: str) -> Reply:
        try:
            return _code_judge_reply(await self._post("/run", {"type": "python", "solution": code}))
        except _Lost as e:
            return Reply("lost", detail=str(e))
        except _HttpError as e:
            return Reply("error", detail=str(e))


class CodeJudgeLongBatch(_Http):
    """code-judge's `POST /run/long-batch` driven as the rStar2 release's client drives it
    (microsoft/rStar rstar2_agent/tools/request_processor.py, code_judge_utils.py, code_judge_tool.py,
    with the release's tool config): SENDERS sender coroutines, each taking the first queued call and,
    without waiting, whatever else is queued, up to BATCH, and POSTing them as one long batch over at
    most SENDERS connections with a 60 s request timeout; results matched by position. Calls answered
    `queue_timeout`, and whole batches whose request failed, are sent again, up to ATTEMPTS attempts
    with BACKOFF_S * 2^k s between them (call_long_batch). Unlike the release, there is no sleep after
    an attempt that succeeded (its `finally:` sleeps after every attempt, 0.5 s per batch), which would
    measure that client rather than code-judge's server."""

    name = "code-judge long-batch"
    SENDERS, BATCH, ATTEMPTS, BACKOFF_S = 8, 32, 4, 0.5
    connections = SENDERS
    timeout_s = 60.0

    async def __aenter__(self):
        await super().__aenter__()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.senders = [asyncio.create_task(self._sender()) for _ in range(self.SENDERS)]
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self.senders:
            t.cancel()
        await asyncio.gather(*self.senders, return_exceptions=True)
        await super().__aexit__(*exc)

    async def execute(self, code: str) -> Reply:
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((code, future))
        return await future

    async def _sender(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            replies = await self._send([code for code, _ in batch])
            for (_, future), reply in zip(batch, replies):
                if not future.done():
                    future.set_result(reply)

    async def _send(self, codes: list[str]) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(codes)
        todo, last = list(range(len(codes))), "never sent"
        for attempt in range(self.ATTEMPTS):
            if attempt:
                await asyncio.sleep(self.BACKOFF_S * 2 ** (attempt - 1))
            body = {"type": "batch", "submissions": [{"type": "python", "solution": codes[i]} for i in todo]}
            try:
                results = (await self._post("/run/long-batch", body))["results"]
            except (_Lost, _HttpError, KeyError) as e:
                last = f"{type(e).__name__}: {e}"[:200]
                continue
            again = []
            for i, res in zip(todo, results):
                reply = _code_judge_reply(res)
                if reply.detail == "queue_timeout":
                    again.append(i)
                    last = "queue_timeout"
                else:
                    replies[i] = reply
            again += todo[len(results):]  # a short answer: the missing ones go again
            todo = again
            if not todo:
                break
        for i in todo:
            replies[i] = Reply("lost", detail=f"gave up after {self.ATTEMPTS} attempts: {last}")
        return replies


class Fusion(_Http):
    """SandboxFusion's `POST /run_code` (language python), run_timeout and memory_limit_MB set to the
    limits (SandboxFusion applies memory_limit_MB as RLIMIT_AS in its default isolation, "none")."""

    name = "SandboxFusion"

    def __init__(self, url: str, limits: Limits):
        super().__init__(url)
        self.limits = limits

    async def execute(self, code: str) -> Reply:
        body = {"code": code, "language": "python", "run_timeout": self.limits.timeout_s,
                "memory_limit_MB": self.limits.memory_mb}
        try:
            res = await self._post("/run_code", body)
        except _Lost as e:
            return Reply("lost", detail=str(e))
        except _HttpError as e:
            return Reply("error", detail=str(e))
        run = res.get("run_result") or {}
        out, err = run.get("stdout") or "", run.get("stderr") or ""
        detail = f"{res.get('status')}/{run.get('status')}"
        if res.get("message"):
            detail += f": {res['message'][:200]}"
        if run.get("status") == "TimeLimitExceeded":
            return Reply("timeout", out, err, detail)
        return Reply("ok" if res.get("status") == "Success" else "error", out, err, detail)


async def detect_kind(url: str) -> str:
    """code-judge answers `GET /status` with its queue and worker count; SandboxFusion answers
    `GET /v1/ping`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        with _suppress_http():
            async with s.get(url.rstrip("/") + "/status") as r:
                if r.status == 200 and "num_workers" in await r.json(content_type=None):
                    return "code-judge"
        with _suppress_http():
            async with s.get(url.rstrip("/") + "/v1/ping") as r:
                if r.status == 200:
                    return "fusion"
    raise ValueError(f"--peer {url}: neither code-judge (GET /status) nor SandboxFusion (GET /v1/ping) answered; "
                     f"name the kind: --peer code-judge=URL or --peer fusion=URL")


def _suppress_http():
    return contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError)


def parse_peer(spec: str) -> tuple[str | None, str]:
    """`URL`, `code-judge=URL` or `fusion=URL` -> (kind or None, URL)."""
    kind, sep, url = spec.partition("=")
    if not sep or "://" in kind:
        kind, url = None, spec
    elif kind not in KINDS:
        raise ValueError(f"--peer {spec!r}: the kind must be one of {KINDS}")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"--peer {spec!r}: expected an http:// URL")
    return kind, url


def peer_drivers(kind: str, url: str, limits: Limits) -> list:
    """The variants a user would compare: code-judge's /run and its long batches; SandboxFusion."""
    if kind == "code-judge":
        return [CodeJudgeRun(url), CodeJudgeLongBatch(url)]
    return [Fusion(url, limits)]


async def peer_status(kind: str, url: str) -> str:
    """A line on the peer's own state (code-judge's worker count), for the report."""
    if kind != "code-judge":
        return ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        with _suppress_http():
            async with s.get(url.rstrip("/") + "/status") as r:
                st = await r.json(content_type=None)
                return f"{st.get('num_workers')} workers registered, queue {st.get('queue')}"
    return "GET /status failed"


# -- what runs inside: limits in force and hostile snippets -----------------------------------------

MARK = "PROBE "


def probe_code(body: str) -> str:
    """`body` fills the dict `out`; it is printed as one JSON line after MARK, with the exception that
    ended `body`, if any (MemoryError included)."""
    return (f"import json\nout = {{}}\ntry:\n{textwrap.indent(textwrap.dedent(body).strip(), '    ')}\n"
            f"except BaseException as e:\n    out['error'] = f'{{type(e).__name__}}: {{e}}'[:160]\n"
            f"print({MARK!r} + json.dumps(out), flush=True)\n")


def probe_output(reply: Reply) -> dict | None:
    for line in reply.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return None


LIMITS_PROBE = probe_code("""
    import resource
    out['as_mb'] = resource.getrlimit(resource.RLIMIT_AS)[0]
    out['cpu_s'] = resource.getrlimit(resource.RLIMIT_CPU)[0]
""")


def describe_limits(reply: Reply) -> str:
    """RLIMIT_AS and RLIMIT_CPU (soft) seen inside a call; the wall-clock limit cannot be seen there."""
    out = probe_output(reply)
    if out is None:
        return f"limits probe failed: {reply.outcome} {reply.detail} {reply.stderr[-160:]!r}"
    fmt = lambda v, unit, scale: "none" if v < 0 else f"{v / scale:g} {unit}"  # noqa: E731  (RLIM_INFINITY is -1)
    return f"RLIMIT_AS {fmt(out['as_mb'], 'MB', 1 << 20)}, RLIMIT_CPU {fmt(out['cpu_s'], 's', 1)}"


def host_process_count() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


class Listener:
    """A TCP listener on 127.0.0.1 (a random port) that records what connects to it: the target of the
    loopback snippet. Never any other address."""

    def __init__(self):
        self.received: list[bytes] = []

    async def __aenter__(self) -> "Listener":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _accept(self, reader, writer) -> None:
        try:
            self.received.append(await asyncio.wait_for(reader.read(64), 5))
        except (asyncio.TimeoutError, OSError):
            self.received.append(b"")
        finally:
            writer.close()


class Hostile:
    """One run of the hostile snippets against one sandbox. `snippets()` gives (name, code);
    `judge(name, reply)` (after the call returned) gives (contained: True/False/None, evidence).
    The last one first lifts its own soft RLIMIT_AS and RLIMIT_DATA to their hard limits, as hostile
    code would: a limit set as a soft rlimit only (code-judge's, SandboxFusion's) does not hold then."""

    NAMES = ("read /etc/shadow", "write outside workdir", "list host processes", "connect to loopback",
             "allocate past limit", "lift limits, allocate")

    def __init__(self, listener: Listener, alloc_mb: int):
        self.listener = listener
        self.alloc_mb = alloc_mb
        self.path = f"/var/tmp/rstar_probe_{secrets.token_hex(6)}"  # where the write snippet aims, checked here
        self.token = secrets.token_hex(8).encode()  # what the loopback snippet sends, so its connection is known
        self.host_processes = 0

    def snippets(self) -> list[tuple[str, str]]:
        me = os.getpid()
        return list(zip(self.NAMES, [
            # Only whether it was readable and its length: never its contents.
            probe_code("out['read_bytes'] = len(open('/etc/shadow', 'rb').read())"),
            probe_code(f"open({self.path!r}, 'w').write('probe')\nout['wrote'] = True"),
            probe_code(f"""
                import os
                out['count'] = sum(1 for p in os.listdir('/proc') if p.isdigit())
                try:
                    out['sees_benchmark'] = b'sandbox_throughput' in open('/proc/{me}/cmdline', 'rb').read()
                except OSError:
                    out['sees_benchmark'] = False
            """),
            probe_code(f"""
                import socket
                s = socket.create_connection(('127.0.0.1', {self.listener.port}), timeout=2)
                out['connected'] = True
                s.sendall({self.token!r})
                s.close()
            """),
            probe_code(f"out['allocated_mb'] = len(bytearray({self.alloc_mb} << 20)) >> 20"),
            probe_code(f"""
                import resource
                lifted = []
                for which in ('RLIMIT_AS', 'RLIMIT_DATA'):
                    hard = resource.getrlimit(getattr(resource, which))[1]
                    try:
                        resource.setrlimit(getattr(resource, which), (hard, hard))
                        lifted.append(which + ' to ' + ('unlimited' if hard < 0 else f'{{hard >> 20}} MB'))
                    except (ValueError, OSError) as e:
                        lifted.append(which + f' not ({{type(e).__name__}})')
                out['lifted'] = ', '.join(lifted)
                out['allocated_mb'] = len(bytearray({self.alloc_mb} << 20)) >> 20
            """),
        ]))

    def before(self, name: str) -> None:
        if name == "list host processes":
            self.host_processes = host_process_count()

    def judge(self, name: str, reply: Reply) -> tuple[bool | None, str]:
        out = probe_output(reply)
        why = (out or {}).get("error") or f"no probe output ({reply.outcome}: {reply.detail or reply.stderr[-120:]})"
        if name == "read /etc/shadow":
            if out and "read_bytes" in out:
                return False, f"read {out['read_bytes']} bytes"
            return (True, why) if out else (None, why)
        if name == "write outside workdir":
            on_host = os.path.exists(self.path)
            if on_host:
                os.unlink(self.path)
                return False, f"{self.path} appeared on the host (removed)"
            if out and out.get("wrote"):
                return True, f"the write succeeded inside, but {self.path} is not on the host (a private view)"
            return True, why
        if name == "list host processes":
            if not out or "count" not in out:
                return None, why
            seen = f"sees {out['count']} processes (host {self.host_processes})"
            return (False, seen + ", the benchmark's own among them") if out["sees_benchmark"] else (True, seen)
        if name == "connect to loopback":
            got = self.token in self.listener.received
            if got or (out and out.get("connected")):
                return False, "connected to the benchmark's 127.0.0.1 listener" + ("" if got else " (token not seen)")
            return (True, why) if out else (None, why)
        if name in ("allocate past limit", "lift limits, allocate"):
            lifted = f"lifted soft {out['lifted']}; " if out and "lifted" in out else ""
            if out and "allocated_mb" in out:
                return False, f"{lifted}allocated {out['allocated_mb']} MB"
            if out:
                return True, lifted + why
            # Killed before printing: contained as long as the sandbox stopped it.
            return (True, f"killed ({reply.detail})") if reply.outcome != "ok" else (None, why)
        raise ValueError(name)
