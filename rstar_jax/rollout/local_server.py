"""`python -m rstar_jax.serve` as a subprocess on a free loopback port, for one machine's runs and tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

HEALTH_TIMEOUT_S = 20.0


class LocalServer:
    """Runs `python -m rstar_jax.serve` as a subprocess on a free loopback port until the context exits.

        with LocalServer("tiny", slots=4, max_length=256) as server:
            generator = SGLangGenerator(server.url)
    """

    def __init__(self, model: str = "tiny", *, slots: int = 4, max_length: int = 512,
                 max_total_tokens: int | None = None, page_size: int = 16, seed: int = 0,
                 host: str = "127.0.0.1", startup_timeout_s: float = 300.0, env: dict | None = None):
        self.model, self.slots, self.max_length, self.seed, self.host = model, slots, max_length, seed, host
        self.max_total_tokens, self.page_size = max_total_tokens, page_size
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "LocalServer":
        self._tmp = tempfile.TemporaryDirectory(prefix="rstar_serve_")
        port_file = os.path.join(self._tmp.name, "port")
        self._log = open(os.path.join(self._tmp.name, "server.log"), "w+")
        cmd = [sys.executable, "-m", "rstar_jax.serve", "--model", self.model, "--host", self.host, "--port", "0",
               "--slots", str(self.slots), "--max-length", str(self.max_length), "--seed", str(self.seed),
               "--page-size", str(self.page_size), "--port-file", port_file]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while not os.path.exists(port_file):
                if self.process.poll() is not None:
                    raise RuntimeError(f"rstar_jax.serve exited with {self.process.returncode}:\n{self._log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rstar_jax.serve not ready after {self.startup_timeout_s}s:\n{self._log_tail()}")
                time.sleep(0.05)
            self.port = int(pathlib.Path(port_file).read_text())
            with urllib.request.urlopen(self.url + "/health_generate", timeout=HEALTH_TIMEOUT_S + 5) as response:
                if response.status != 200:
                    raise RuntimeError(f"{self.url}/health_generate answered {response.status}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

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
        self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()

