"""Starts and stops a real `sglang.launch_server` (SGLang 0.5.23, CPU engine) for tests.

Importable from the project's own environment: only the standard library is used here, because
SGLang and its torch live in a separate environment (tests/real_sglang/setup.sh builds it) that is
reached only through its interpreter, ENV_DIR/bin/python.

    with sglang_server(env_dir(), model_dir, context_length=1024) as server:
        url, process = server            # or server.url, server.process, server.log_path
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
SETUP_SH = "tests/real_sglang/setup.sh"
# Written by setup.sh as its last step, after its smoke check passed.
COMPLETE_STAMP = ".rstar-sglang-complete"


def env_dir() -> pathlib.Path:
    """The SGLang environment: `$RSTAR_SGLANG_ENV`, else `<repo>/.venv-sglang` (setup.sh's default)."""
    return pathlib.Path(os.environ.get("RSTAR_SGLANG_ENV") or REPO / ".venv-sglang")


def env_problem(path: str | os.PathLike | None = None) -> str | None:
    """Why the environment at `path` (default `env_dir()`) cannot run a server, or None if it can."""
    path = pathlib.Path(path) if path is not None else env_dir()
    if not (path / "bin" / "python").is_file():
        return f"no SGLang environment at {path} (build it with {SETUP_SH} [ENV_DIR])"
    if not (path / COMPLETE_STAMP).is_file():
        return f"the SGLang environment at {path} is incomplete (re-run {SETUP_SH} {path})"
    return None


def env_is_complete(path: str | os.PathLike | None = None) -> bool:
    return env_problem(path) is None


def free_port() -> int:
    """A loopback port that was free a moment ago (the kernel's pick, so parallel runs rarely clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class SGLangServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: pathlib.Path
    command: tuple[str, ...]

    def __iter__(self):  # `url, process = server`
        return iter((self.url, self.process))

    def log_tail(self, chars: int = 6000) -> str:
        return _tail(self.log_path, chars)


def _tail(path: pathlib.Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"<log {path} unreadable: {e}>"


def server_command(env: str | os.PathLike, model_dir: str | os.PathLike, *, port: int,
                   context_length: int, max_total_tokens: int, skip_tokenizer_init: bool = True,
                   dtype: str = "float32", extra_args: Sequence[str] = ()) -> list[str]:
    """The launch command. CPU-only flags: --device cpu with the torch_native attention backend (the
    CUDA backends' kernels do not exist here) and no CUDA graphs; an explicit --max-total-tokens,
    because on CPU SGLang would otherwise size the KV pool from a fraction of host memory."""
    cmd = [str(pathlib.Path(env) / "bin" / "python"), "-m", "sglang.launch_server",
           "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
           "--dtype", dtype, "--context-length", str(context_length),
           "--max-total-tokens", str(max_total_tokens)]
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")  # token-in/token-out; tiny checkpoints have no tokenizer
    return cmd + [str(a) for a in extra_args]


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           # The project's environment must not leak into SGLang's interpreter.
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU engine (needs the sgl_kernel stand-in)
    # Models are local directories; no hub look-ups (the network here reaches package registries only).
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"  # the log is current when a failure shows its tail
    return env


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def stop_process_group(process: subprocess.Popen, grace: float = 20.0) -> None:
    """Stops the server and every process it started (they share its process group): SIGTERM, then
    SIGKILL to the whole group for whatever is left after `grace` seconds.

    SIGTERM goes to the launcher alone while it lives: it then shuts down uvicorn and its scheduler
    and detokenizer itself (~6 s, exit 0). SIGTERM to the whole group instead kills the scheduler
    first, which the launcher treats as a crash (5 s diagnostics sleep, then SIGQUIT)."""
    pgid = process.pid  # start_new_session=True: the server leads its own group
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):
        if process.poll() is None:
            os.kill(pgid, signal.SIGTERM)
        else:
            os.killpg(pgid, signal.SIGTERM)  # orphaned children, if any
    if not _wait_group_gone(process, deadline):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        _wait_group_gone(process, time.monotonic() + 10)  # until init has reaped the orphans
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _wait_group_gone(process: subprocess.Popen, deadline: float) -> bool:
    while True:
        process.poll()  # reap the leader so it does not linger as a zombie group member
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True  # nobody left in the group
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@contextlib.contextmanager
def sglang_server(env: str | os.PathLike, model_dir: str | os.PathLike, *, port: int | None = None,
                  context_length: int = 1024, max_total_tokens: int = 8192,
                  extra_args: Sequence[str] = (), skip_tokenizer_init: bool = True,
                  dtype: str = "float32", log_path: str | os.PathLike | None = None,
                  startup_timeout: float = 600.0, stop_grace: float = 20.0) -> Iterator[SGLangServer]:
    """Runs a real SGLang server until the block exits.

    `extra_args`: more launch flags, e.g. ("--enable-deterministic-inference",) or
    ("--load-snapshot-publish-interval", "1"). Readiness is `/health_generate` answering 200 (a real
    forward pass), within `startup_timeout` seconds (about 40 s to 2 minutes on 2 cores); otherwise,
    or if the server exits first, RuntimeError with the log's tail. On exit the whole process group
    is stopped, whatever happened in the block."""
    problem = env_problem(env)
    if problem:
        raise RuntimeError(problem)
    port = port or free_port()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = pathlib.Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(env, model_dir, port=port, context_length=context_length,
                         max_total_tokens=max_total_tokens, skip_tokenizer_init=skip_tokenizer_init,
                         dtype=dtype, extra_args=extra_args)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_server_env(), cwd=tempfile.gettempdir(), start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {process.returncode} before it was "
                                   f"ready; log {log_path}:\n{_tail(log_path, 6000)}")
            try:
                if _get(url + "/health_generate", timeout=10) == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang server at {url} not ready after {startup_timeout:.0f} s; "
                                   f"log {log_path}:\n{_tail(log_path, 6000)}")
            time.sleep(1.0)
        yield SGLangServer(url=url, process=process, log_path=log_path, command=tuple(cmd))
    finally:
        stop_process_group(process, grace=stop_grace)
