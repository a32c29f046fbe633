"""The rollout loop's tool executor on SandboxFusion deployments: servers speaking SandboxFusion's
HTTP API (`POST /run_code`, `GET /v1/ping`), bytedance/SandboxFusion's or this package's own server
started with `--http-port`.

    async with SandboxFusionExecutor(["http://10.0.0.5:8080", "http://10.0.0.6:8080"]) as executor:
        r = await executor.execute("x = 6 * 7\\nx")     # r.status == "ok", r.stdout == "42\\n"

`execute` takes `SandboxClient.execute`'s options and returns its `ExecResult`, with our status names,
so the loop and its observations cannot tell the two apart. SandboxFusion only runs scripts, so our
tool semantics travel with each request: this package's harness (sandbox_service/harness.py,
standard library only) and the user's code go as `files`, and `code` is a short driver that runs the
code through the harness exactly as the gRPC sandbox does (a trailing expression's repr displayed;
errors in `error_format`: tracebacks trimmed to the user's code, or the release's one-line errors;
Python's exit codes). The harness reports a MemoryError in a file read back with `fetch_files`, so
memory_limit is told apart from other errors. Nothing runs on this machine.

Options: timeout_s -> run_timeout (None: SandboxFusion's default, 10 s); memory_mb -> memory_limit_MB,
which SandboxFusion applies as RLIMIT_AS (in its default isolation mode, "none"; its "lite" mode
ignores it for a 4 GB cgroup): only an address-space limit (memory_address_space=True) can be
honoured. Each call is a fresh interpreter: only cold_imports=True (or None). stream_cap_chars > 0:
each stream is cut here to that many characters and the status stands, as the sandbox does; 0 (or
None): a stream over the sandbox's 64 KiB byte cap is cut there, with its marker, and the status is
output_limit (the program ran on remotely; the gRPC sandbox would have killed it). An option that
cannot be honoured raises ValueError naming it.

Several URLs: a call goes to the one with the fewest calls in flight from here (ties in turn), with
at most `connections_per_url` connections each. Connection failures, HTTP 5xx (a full queue answers
504) and SandboxError answers are retried with exponential backoff up to `max_retries` times, a URL
that failed being skipped for `down_s` seconds; then the call returns status sandbox_error with the
reason. A request the server refuses (HTTP 4xx) returns status rejected with its detail. Service
failures never raise.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import logging
import math
import pathlib
import re
import signal
import time
import urllib.parse
from typing import Sequence

import aiohttp

from sandbox_service import harness, selftest, status
from sandbox_service.client import ExecResult, backoff_delay, pick_endpoint
from sandbox_service.harness import ERROR_FORMATS
from sandbox_service.status import MAX_STREAM_CAP_CHARS, TRUNCATION_MARKER

log = logging.getLogger("sandbox_service.fusion_client")

DEFAULT_RUN_TIMEOUT_S = 10.0  # RunCodeRequest.run_timeout's default
OUTPUT_LIMIT_BYTES = 64 << 10  # the sandbox server's default byte cap per stream (ServerOptions.output_limit_bytes)
HARNESS_FILE = "_rstar_harness.py"
CODE_FILE = "_rstar_code.py"
META_FILE = "_rstar_meta"
# The notes the sandbox's workers append to stderr (not in the release's format).
TIMEOUT_NOTE = f"\n{status.TIMEOUT_NOTE}\n"
SIGNAL_NOTE = "\n[killed by signal {}]\n"
_TRAILING_NOTE = re.compile(r"\n\[killed[^\n]*\]\n\Z")

# Runs the user's code through the harness (the files beside it), then removes them, so that the
# program finds the working directory as SandboxFusion left it. The harness exits the process.
_DRIVER = """\
def _main():
    import importlib.util, os
    spec = importlib.util.spec_from_file_location("_rstar_harness", os.path.abspath({harness!r}))
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    with open({code!r}, "rb") as f:
        code = f.read().decode("utf-8", "replace")
    for name in ({harness!r}, {code!r}):
        try:
            os.remove(name)
        except OSError:
            pass
    try:
        meta = os.open({meta!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        meta = os.open(os.devnull, os.O_WRONLY)
    harness.run_program(code, meta, error_format={error_format!r})


_main()
"""

_harness_b64: str | None = None


def _harness_source_b64() -> str:
    global _harness_b64
    if _harness_b64 is None:
        _harness_b64 = base64.b64encode(pathlib.Path(harness.__file__).read_bytes()).decode("ascii")
    return _harness_b64


class _Endpoint:
    def __init__(self, url: str, session: aiohttp.ClientSession):
        self.url = url
        self.session = session
        self.in_flight = 0
        self.down_until = 0.0


class _Retry(Exception):
    """A failure worth another attempt (connection, HTTP 5xx, SandboxError); `down`: skip the URL."""

    def __init__(self, message: str, *, down: bool = False):
        super().__init__(message)
        self.down = down


class _Refused(Exception):
    """The server refused the request itself (HTTP 4xx): not retried."""


def _check_url(url) -> str:
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"SandboxFusionExecutor: urls must be http(s) base URLs ('http://host:port'); got {url!r}")
    return url.rstrip("/")


class SandboxFusionExecutor:
    def __init__(self, urls: str | Sequence[str], *, timeout_s: float | None = None, memory_mb: int | None = None,
                 memory_address_space: bool | None = None, stream_cap_chars: int | None = None,
                 error_format: str | None = None, cold_imports: bool | None = None, max_retries: int = 5,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, down_s: float = 5.0,
                 connections_per_url: int = 64, connect_timeout_s: float = 10.0, request_timeout_s: float = 900.0):
        """urls: SandboxFusion base URLs ("http://host:port"). timeout_s ... cold_imports: defaults for
        every call (see `execute`). request_timeout_s bounds one attempt (the server's queueing
        included); connect_timeout_s its connection."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SandboxFusionExecutor: urls must list at least one SandboxFusion base URL")
        self.targets = [_check_url(u) for u in urls]
        if max_retries < 0 or backoff_s < 0 or max_backoff_s < 0 or down_s < 0 or connections_per_url < 1 \
                or connect_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("SandboxFusionExecutor: max_retries, backoff_s, max_backoff_s, down_s >= 0, "
                             "connections_per_url >= 1 and positive timeouts are required")
        self.defaults = {"timeout_s": timeout_s, "memory_mb": memory_mb, "memory_address_space": memory_address_space,
                         "stream_cap_chars": stream_cap_chars, "error_format": error_format,
                         "cold_imports": cold_imports}
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.down_s = down_s
        self.connections_per_url = connections_per_url
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._endpoints: list[_Endpoint] | None = None
        self._rr = itertools.count()
        self._closed = False
        self._options({})  # bad or unsupported defaults fail here, naming the option

    # -- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> "SandboxFusionExecutor":
        self._ensure_started()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("SandboxFusionExecutor is closed")
        if self._endpoints is None:  # sessions belong to the running event loop
            self._endpoints = [
                _Endpoint(url, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections_per_url),
                                                     timeout=self.timeout))
                for url in self.targets]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ep in self._endpoints or []:
            await ep.session.close()

    async def ping(self, target: str | None = None) -> bool:
        """Whether `target` (default: the first URL) answers SandboxFusion's `GET /v1/ping` with "pong"."""
        self._ensure_started()
        url = _check_url(target) if target else self.targets[0]
        ep = next((e for e in self._endpoints if e.url == url), None)
        if ep is None:
            raise ValueError(f"ping: unknown target {target!r}; known: {self.targets}")
        try:
            async with ep.session.get(f"{ep.url}/v1/ping", timeout=aiohttp.ClientTimeout(total=30)) as r:
                return r.status == 200 and json.loads(await r.read()) == "pong"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return False

    ready_probe = "/v1/ping"  # what `ready` asks first, for messages about servers that do not answer

    async def ready(self, target: str,
                    modules: Sequence[str] = selftest.STANDARD_MODULES) -> tuple[str, list[str]] | None:
        """None while `target` does not answer `/v1/ping`; then a line on what tool code imports there
        and one problem per module of `modules` it cannot import (the self-test, run as a call)."""
        try:
            if not await self.ping(target):
                return None
        except Exception:  # noqa: BLE001  (any failure to answer: not ready yet)
            return None
        checks = await self.self_test(target, modules)
        return (f"{target}: tool code imports {selftest.summary(checks) or 'none of them'} (cold)",
                selftest.failures(checks))

    async def self_test(self, target: str, modules) -> list[selftest.ImportCheck]:
        """What `Info`'s start-up self-test reports on our server, run as an ordinary call on `target`:
        whether tool code imports each of `modules` (cold: SandboxFusion starts a fresh interpreter
        per call)."""
        result = await self.execute(selftest.probe_code(modules), timeout_s=selftest.TIMEOUT_S, target=target)
        failure = f"the self-test call ended with status {result.status}: {(result.message or result.stderr).strip()[-300:]}"
        return selftest.parse_probe(result.stdout, modules, "cold", failure=failure)

    # -- options -------------------------------------------------------------------------------------
    def _options(self, given: dict) -> dict:
        o = {name: given.get(name) if given.get(name) is not None else default
             for name, default in self.defaults.items()}
        t = o["timeout_s"]
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t <= 0):
            raise ValueError(f"timeout_s must be a positive number of seconds; got {t!r}")
        m = o["memory_mb"]
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"memory_mb must be a positive integer; got {m!r}")
        cap = o["stream_cap_chars"]
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                                or not 0 <= cap <= MAX_STREAM_CAP_CHARS):
            raise ValueError(f"stream_cap_chars must be an int in [0, {MAX_STREAM_CAP_CHARS}] (0: the sandbox's "
                             f"byte cap); got {cap!r}")
        if o["error_format"] is not None and o["error_format"] not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}; got {o['error_format']!r}")
        for flag in ("cold_imports", "memory_address_space"):
            if o[flag] is not None and not isinstance(o[flag], bool):
                raise TypeError(f"{flag} must be a bool; got {type(o[flag]).__name__}")
        if o["memory_address_space"] is False or (m is not None and o["memory_address_space"] is None):
            raise ValueError("memory_address_space=False (a resident-memory limit) cannot be honoured on "
                             "SandboxFusion, whose memory_limit_MB bounds the address space (RLIMIT_AS): pass "
                             "memory_address_space=True")
        if o["cold_imports"] is False:
            raise ValueError("cold_imports=False (pre-imported modules) cannot be honoured on SandboxFusion, which "
                             "starts a fresh interpreter per call: pass cold_imports=True")
        return o

    # -- execute -------------------------------------------------------------------------------------
    async def execute(self, code: str, stdin: str = "", *, timeout_s: float | None = None,
                      memory_mb: int | None = None, stream_cap_chars: int | None = None,
                      error_format: str | None = None, cold_imports: bool | None = None,
                      memory_address_space: bool | None = None, target: str | None = None) -> ExecResult:
        """Runs `code` with `stdin` on one of the servers (`target`: on that one, retried there only);
        the options as `SandboxClient.execute`'s (None: this executor's default), those SandboxFusion
        cannot honour refused (module docstring)."""
        self._ensure_started()
        pinned = None
        if target is not None:
            url = _check_url(target)
            pinned = next((e for e in self._endpoints if e.url == url), None)
            if pinned is None:
                raise ValueError(f"execute: unknown target {target!r}; known: {self.targets}")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str; got {type(code).__name__}")
        if not isinstance(stdin, str):
            raise TypeError(f"stdin must be a str; got {type(stdin).__name__}")
        o = self._options({"timeout_s": timeout_s, "memory_mb": memory_mb, "stream_cap_chars": stream_cap_chars,
                           "error_format": error_format, "cold_imports": cold_imports,
                           "memory_address_space": memory_address_space})
        timeout = float(o["timeout_s"] or DEFAULT_RUN_TIMEOUT_S)
        error_format = o["error_format"] or ""
        stdin.encode("utf-8")  # a lone surrogate fails here, as it does in the gRPC client
        payload = {
            "code": _DRIVER.format(harness=HARNESS_FILE, code=CODE_FILE, meta=META_FILE, error_format=error_format),
            "language": "python", "stdin": stdin, "run_timeout": timeout,
            "memory_limit_MB": o["memory_mb"] if o["memory_mb"] else -1,
            "files": {HARNESS_FILE: _harness_source_b64(),
                      CODE_FILE: base64.b64encode(code.encode("utf-8")).decode("ascii")},
            "fetch_files": [META_FILE]}
        body = json.dumps(payload).encode()
        last, target = "", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            ep = pinned or self._pick()
            target = ep.url
            ep.in_flight += 1
            try:
                answer = await self._post(ep, body)
                return self._result(answer, timeout, o["stream_cap_chars"] or 0, error_format, attempt + 1, ep.url)
            except _Retry as e:
                last = str(e)
                if e.down:
                    ep.down_until = time.monotonic() + self.down_s
                log.debug("SandboxFusion call to %s failed (attempt %d): %s", ep.url, attempt + 1, last)
            except _Refused as e:
                return _failure(status.REJECTED, f"{ep.url} refused the request: {e}", attempt + 1, ep.url)
            finally:
                ep.in_flight -= 1
        message = f"gave up after {self.max_retries + 1} attempts: {last}"
        log.warning("SandboxFusion call %s", message)
        return _failure(status.SANDBOX_ERROR, message, self.max_retries + 1, target)

    def _pick(self) -> _Endpoint:
        return pick_endpoint(self._endpoints, self._rr)

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.backoff_s, self.max_backoff_s)

    async def _post(self, ep: _Endpoint, body: bytes) -> dict:
        try:
            async with ep.session.post(f"{ep.url}/run_code", data=body,
                                       headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                code = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _Retry(f"{ep.url}: {type(e).__name__}: {e}", down=True) from None
        if code >= 500 or code in (408, 429):
            # 504: a gateway's timeout or a full queue (ours): busy, not down.
            raise _Retry(f"{ep.url} answered HTTP {code}: {_detail(raw)}", down=code >= 500 and code != 504)
        if code != 200:
            raise _Refused(f"HTTP {code}: {_detail(raw)}")
        try:
            answer = json.loads(raw)
        except ValueError as e:
            raise _Retry(f"{ep.url} answered invalid JSON: {e}") from None
        if not isinstance(answer, dict):
            raise _Retry(f"{ep.url} answered {type(answer).__name__}, not a RunCodeResponse")
        return answer

    def _result(self, answer: dict, timeout: float, cap: int, error_format: str, attempts: int,
                target: str) -> ExecResult:
        """RunCodeResponse -> ExecResult (our statuses; streams capped and noted as the sandbox does)."""
        run = answer.get("run_result") if isinstance(answer.get("run_result"), dict) else None
        if answer.get("status") == "SandboxError" or run is None or run.get("status") == "Error":
            why = answer.get("message") or (run or {}).get("stderr") or "no run_result"
            raise _Retry(f"{target} answered SandboxError: {str(why)[-2000:]}")
        run_status, rc = run.get("status"), run.get("return_code")
        stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
        memory_error = _meta(answer).startswith(harness.MEMORY_ERROR_TAG)
        note = ""
        if run_status == "TimeLimitExceeded":
            code, exit_code, note = status.TIMEOUT, -signal.SIGKILL, TIMEOUT_NOTE.format(timeout)
        elif run_status == "Finished" and isinstance(rc, int) and not isinstance(rc, bool):
            exit_code = rc
            if rc == 0:
                code = status.OK
            elif memory_error:
                code = status.MEMORY_LIMIT
            elif rc < 0:
                code, note = status.KILLED_BY_SIGNAL, SIGNAL_NOTE.format(_signal_name(-rc))
            else:
                code = status.RUNTIME_ERROR
        else:
            raise _Retry(f"{target} answered run_result status {run_status!r} with return_code {rc!r}")
        stderr = _TRAILING_NOTE.sub("", stderr)  # our own server's note; added below as the sandbox adds it
        if cap:
            stdout, out_cut = stdout[:cap], len(stdout) > cap
            stderr, err_cut = stderr[:cap], len(stderr) > cap
        else:
            stdout, out_cut = _byte_cap(stdout)
            stderr, err_cut = _byte_cap(stderr)
            if out_cut or err_cut:  # the sandbox would have killed it for that (no other note)
                code, note = status.OUTPUT_LIMIT, ""
        if note and error_format != "release":  # the release shows the program's own output only
            stderr += note
        return ExecResult(status=code, exit_code=exit_code, stdout=stdout, stderr=stderr,
                          duration_s=float(run.get("execution_time") or 0.0), stdout_truncated=out_cut,
                          stderr_truncated=err_cut, stdout_bytes=stdout.encode("utf-8", "surrogatepass"),
                          stderr_bytes=stderr.encode("utf-8", "surrogatepass"), attempts=attempts, target=target,
                          worker=str(answer.get("executor_pod_name") or ""))


def _failure(code: str, message: str, attempts: int, target: str) -> ExecResult:
    return ExecResult(status=code, exit_code=-1, stdout="", stderr=message, duration_s=0.0, message=message,
                      attempts=attempts, target=target)


def _detail(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError):
        detail = text
    if isinstance(detail, list):  # FastAPI's validation errors
        detail = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', ()))}: {d.get('msg')}" if isinstance(d, dict)
                           else str(d) for d in detail)
    return str(detail)[:2000]


def _meta(answer: dict) -> bytes:
    files = answer.get("files")
    content = files.get(META_FILE) if isinstance(files, dict) else None
    if not isinstance(content, str):
        return b""
    try:
        return base64.b64decode(content)
    except (binascii.Error, ValueError):
        return b""


def _byte_cap(text: str) -> tuple[str, bool]:
    """The sandbox's byte cap: the first OUTPUT_LIMIT_BYTES bytes and its marker, if it is exceeded."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= OUTPUT_LIMIT_BYTES:
        return text, False
    cut = raw[:OUTPUT_LIMIT_BYTES] + TRUNCATION_MARKER.format(OUTPUT_LIMIT_BYTES).encode()
    return cut.decode("utf-8", "replace"), True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
