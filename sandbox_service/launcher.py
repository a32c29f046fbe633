"""Start a real sandbox server on this host as a subprocess (tests, single-machine runs).

    with LocalSandbox(workers=2) as sandbox:
        async with SandboxClient(sandbox.target) as client: ...

    async with LocalSandbox(workers=2, timeout_s=4.0) as sandbox: ...

    with LocalSandbox(workers=2, http_port=0) as sandbox:   # also SandboxFusion's HTTP API
        async with SandboxFusionExecutor(sandbox.http_url) as executor: ...

`stop()` terminates the server, which stops its workers; whatever is left of the server's process
group is then killed, so no process survives. The server also stops by itself when the process that
started it exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc

from sandbox_service._pb import pb2, pb2_grpc

_FLAGS = {"host", "slots", "timeout_s", "max_timeout_s", "memory_mb", "max_memory_mb", "max_queue",
          "output_limit_bytes", "verify_timeout_s", "scratch_mb", "pids_max", "isolation", "uid_base", "log_level",
          "preimport", "inject_timeout_rate", "inject_seed"}


class LocalSandbox:
    def __init__(self, workers: int = 2, port: int = 0, *, http_port: int | None = None,
                 start_timeout_s: float = 180.0, log_file=None, python: str | None = None, **server_opts):
        """http_port: also serve SandboxFusion's HTTP API there (0: any free port; see `http_url`);
        None: gRPC only. python: the interpreter that runs the server and the tool code (default:
        this one). server_opts: the server's flags by name (`preimport`: a sequence of modules)."""
        unknown = set(server_opts) - _FLAGS
        if unknown:
            raise ValueError(f"LocalSandbox: unknown server options {sorted(unknown)}; known: {sorted(_FLAGS)}")
        self.workers = workers
        self.port = port
        self.http_port = http_port
        self.host = server_opts.get("host", "127.0.0.1")
        self.server_opts = server_opts
        self.start_timeout_s = start_timeout_s
        self.log_file = log_file
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def target(self) -> str:
        if self.proc is None:
            raise RuntimeError("LocalSandbox is not running")
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """The base URL of SandboxFusion's HTTP API (`http://host:port`; POST /run_code, GET /v1/ping)."""
        if self.proc is None:
            raise RuntimeError("LocalSandbox is not running")
        if self.http_port is None:
            raise RuntimeError("LocalSandbox was started without its HTTP API (pass http_port=0)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    def command(self, port_file: str) -> list[str]:
        cmd = [self.python, "-m", "sandbox_service", "--port", str(self.port), "--workers", str(self.workers),
               "--port-file", port_file, "--parent-pid", str(os.getpid())]
        if self.http_port is not None:
            cmd += ["--http-port", str(self.http_port), "--http-port-file", port_file + ".http"]
        for key, value in self.server_opts.items():
            for one in (value if isinstance(value, (list, tuple)) else [value]):
                cmd += [f"--{key.replace('_', '-')}", str(one)]
        return cmd

    def start(self) -> "LocalSandbox":
        if self.proc is not None:
            raise RuntimeError("LocalSandbox is already running")
        self._dir = tempfile.TemporaryDirectory(prefix="sandbox-launch-")
        port_file = os.path.join(self._dir.name, "port")
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(self.command(port_file), stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=self.log_file, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not os.path.exists(port_file):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sandbox server exited with code {self.proc.returncode} during start-up")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sandbox server did not start within {self.start_timeout_s:.0f}s")
                time.sleep(0.05)
            with open(port_file) as f:
                self.port = int(f.read())
            if self.http_port is not None:  # written before the gRPC port file
                with open(port_file + ".http") as f:
                    self.http_port = int(f.read())
            self._wait_healthy(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        with grpc.insecure_channel(f"{self.host}:{self.port}") as channel:
            stub = pb2_grpc.SandboxStub(channel)
            while True:
                try:
                    if stub.Health(pb2.HealthRequest(), timeout=5).serving:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("sandbox server never reported healthy")
                time.sleep(0.05)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful: workers stop, cgroups removed), then SIGKILL of the whole process group."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything left in the server's process group
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait()
            _wait_until_group_gone(proc.pid, timeout_s=5.0)  # killed processes are gone once reaped
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL of the server and its workers), as in a crash; for fault tests."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def restart(self) -> "LocalSandbox":
        """Stops (if running) and starts again on the same port."""
        self.stop()
        return self.start()

    def __enter__(self) -> "LocalSandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> "LocalSandbox":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)


def _wait_until_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for restart tests that need a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
