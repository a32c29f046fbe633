"""`python -m rstar_jax.serve` as a subprocess on a free loopback port, for one machine's runs and tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HEALTH_TIMEOUT_S = 20.0


class LocalServer:
    """Runs `python -m rstar_jax.serve` as a subprocess on a free loopback port until the context exits.

        with LocalServer("tiny", slots=4, max_length=256) as server:
            generator = SGLangGenerator(server.url)

    The server is started with SGLang's flags (`--max-running-requests` = slots, `--context-length` =
    max_length, `--random-seed` = seed), `--enable-deterministic-inference` (the rollout's seeded
    sampling needs it) and `--enable-metrics`. It serves token ids only (`--skip-tokenizer-init`)
    unless `tokenizer_path` is given. The context is entered once `/health_generate` answers 200.
    `extra_args` are appended to the command line.
    """

    def __init__(self, model: str = "tiny", *, slots: int = 4, max_length: int = 512,
                 max_total_tokens: int | None = None, page_size: int = 16, seed: int = 0,
                 host: str = "127.0.0.1", startup_timeout_s: float = 300.0, env: dict | None = None,
                 tokenizer_path: str | None = None, deterministic: bool = True, extra_args: tuple[str, ...] = ()):
        self.model, self.slots, self.max_length, self.seed, self.host = model, slots, max_length, seed, host
        self.max_total_tokens, self.page_size = max_total_tokens, page_size
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.tokenizer_path, self.deterministic, self.extra_args = tokenizer_path, deterministic, tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, port_file: str) -> list[str]:
        cmd = [sys.executable, "-m", "rstar_jax.serve", "--model-path", self.model, "--host", self.host,
               "--port", "0", "--max-running-requests", str(self.slots), "--context-length", str(self.max_length),
               "--random-seed", str(self.seed), "--page-size", str(self.page_size), "--port-file", port_file,
               "--enable-metrics"]
        cmd += ["--tokenizer-path", self.tokenizer_path] if self.tokenizer_path else ["--skip-tokenizer-init"]
        if self.deterministic:
            cmd.append("--enable-deterministic-inference")
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        return cmd + list(self.extra_args)

    def __enter__(self) -> "LocalServer":
        self._tmp = tempfile.TemporaryDirectory(prefix="rstar_serve_")
        port_file = os.path.join(self._tmp.name, "port")
        self._log = open(os.path.join(self._tmp.name, "server.log"), "w+")
        self.process = subprocess.Popen(self.command(port_file), stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not os.path.exists(port_file):  # written as soon as the socket is bound
                self._check_alive(deadline)
                time.sleep(0.05)
            self.port = int(pathlib.Path(port_file).read_text())
            # 503 while the engine warms up (compiles), as SGLang answers while starting.
            while not self._healthy():
                self._check_alive(deadline)
                time.sleep(0.1)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=HEALTH_TIMEOUT_S + 5) as response:
                return response.status == 200
        except urllib.error.HTTPError as e:
            if e.code == 503:
                return False
            raise RuntimeError(f"{self.url}/health_generate answered {e.code}:\n{self._log_tail()}") from None

    def _check_alive(self, deadline: float) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"rstar_jax.serve exited with {self.process.returncode}:\n{self._log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rstar_jax.serve not ready after {self.startup_timeout_s}s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-4000:]

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
