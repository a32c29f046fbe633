"""Binary answer reward: extract the final answer and verify it against the gold answer.

Extraction and equivalence are the sandbox's pure functions (`sandbox_service.verify`, rStar2 spec
§1.6: the last `\\boxed{}` inside `<answer>`, with fallbacks; normalisation, then math-verify with its
signal-based timeouts disabled), so the local pool and the Verify RPC grade identically. Added here:
a truncated trajectory scores 0 (the paper gives truncated rollouts no reward).

Verification of a model's answer can hang in sympy, so the rollout loop never runs it in the event
loop: `VerifierPool` runs it in worker processes with a hard deadline, killing and replacing a
worker that overruns (the call then scores 0).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from typing import Callable

from sandbox_service.verify import extract_answer, is_equivalent, normalize

__all__ = ["extract_answer", "is_equivalent", "normalize", "score", "VerifierPool", "SandboxScorer", "make_scorer"]


def score(response_text: str, gold_answer: str, *, truncated: bool = False) -> float:
    """1.0 when the response's final answer verifies against the gold answer, else 0.0."""
    if truncated:
        return 0.0
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, gold_answer) else 0.0


# -- hard-timeout verification in worker processes ------------------------------------------------

def _worker(conn, score_fn) -> None:
    import logging

    # math-verify warns on every call that its own timeouts are off; here the pool enforces one.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        text, gold = job
        try:
            conn.send(("ok", score_fn(text, gold)))
        except Exception as e:  # a verifier crash scores 0 but is reported
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, score_fn):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, score_fn), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """Scores responses in `workers` processes; a call past `timeout_s` is killed and scores 0."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, start_method: str = "spawn",
                 score_fn: Callable[[str, str], float] = score):
        """score_fn must be a picklable top-level function (it runs in the workers)."""
        if workers < 1:
            raise ValueError(f"VerifierPool.workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self._ctx = mp.get_context(start_method)
        self._score_fn = score_fn
        self._idle: list[_Worker] = [_Worker(self._ctx, score_fn) for _ in range(workers)]
        self._available = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self.timeouts = 0
        self.errors = 0

    def score_blocking(self, response_text: str, gold_answer: str, *, truncated: bool = False) -> float:
        if truncated:
            return 0.0
        self._available.acquire()
        with self._lock:
            worker = self._idle.pop()
        try:
            worker.conn.send((response_text, gold_answer))
            if worker.conn.poll(self.timeout_s):
                status, value = worker.conn.recv()
                if status == "ok":
                    return float(value)
                self.errors += 1
                return 0.0
            self.timeouts += 1
            worker.kill()
            worker = _Worker(self._ctx, self._score_fn)
            return 0.0
        finally:
            with self._lock:
                self._idle.append(worker)
            self._available.release()

    async def score(self, response_text: str, gold_answer: str, *, truncated: bool = False) -> float:
        return await asyncio.to_thread(self.score_blocking, response_text, gold_answer, truncated=truncated)

    __call__ = score  # a VerifierPool is itself a rollout-loop scorer

    def close(self) -> None:
        with self._lock:
            for worker in self._idle:
                try:
                    worker.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                worker.kill()
            self._idle.clear()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


ScoreFn = Callable[[str, str], float]


class SandboxScorer:
    """Scores through the sandbox's Verify RPC (its own hard timeout); truncated responses score 0."""

    def __init__(self, client, timeout_s: float | None = None):
        self.client = client
        self.timeout_s = timeout_s

    async def __call__(self, response_text: str, gold_answer: str, *, truncated: bool = False) -> float:
        if truncated:
            return 0.0
        result = await self.client.verify(response_text, gold_answer, timeout_s=self.timeout_s)
        return 1.0 if result.correct else 0.0

    def close(self) -> None:
        """The client belongs to the caller; nothing to release here."""


SCORER_MODES = ("local", "sandbox")  # config.sandbox.verify_via


def make_scorer(mode: str, *, timeout_s: float = 10.0, workers: int = 2, sandbox_client=None):
    """The rollout loop's scorer: "local" (a `VerifierPool`, close it when done) or "sandbox"
    (`SandboxScorer` over `sandbox_client`). Both have `.close()`. `timeout_s`: a verification
    running longer scores 0."""
    if mode == "local":
        return VerifierPool(workers=workers, timeout_s=timeout_s)
    if mode == "sandbox":
        if sandbox_client is None:
            raise ValueError("make_scorer: mode 'sandbox' needs a sandbox_client with a verify method")
        return SandboxScorer(sandbox_client, timeout_s=timeout_s)
    raise ValueError(f"make_scorer: mode must be one of {SCORER_MODES}, got {mode!r}")
