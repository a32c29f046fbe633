"""Rollout makespan in simulated time: N simulated SGLang-like engines driven by the real schedulers.

A discrete-event simulation of one RL step's rollout (rStar2-Agent §3.2; spec §4.1) that runs the
project's own `RoundRobinScheduler` and `KvScheduler` objects, unmodified, against simulated
generators under a virtual clock, so a paper-scale step (512 prompts x 32 rollouts on 64 engines)
takes well under a minute of wall time instead of GPU-hours:
- Virtual time: `VirtualTimeLoop` is an asyncio selector event loop whose `time()` is a simulated
  clock and whose selector, instead of sleeping until the next timer, moves the clock to it. Every
  `asyncio.sleep` (tool calls, engine steps) costs no wall time; the schedulers' own asyncio code
  (futures, locks, queues) runs as it does in production.
- `SimEngine` implements `rstar_jax.rollout.protocol.Generator` with SGLang's scheduling, as
  `rstar_jax.engine.jax_engine.JaxEngine` mirrors it: continuous batching in decode steps (one token per
  running request per step; step time a + b x running + c x KV tokens read); admission from a FIFO
  queue (retracted requests first) when the context plus `new_token_ratio` x the remaining budget
  fits beside the same estimate for every running request, with the ratio decaying per step;
  retraction of the request with the fewest output tokens when the pool overflows (its KV freed,
  its context prefilled again on readmission); a max-running cap; a prefix cache keyed by
  trajectory (the next turn on the same engine prefills only its new tokens, unless admissions
  evicted it, least recently cached first, while the trajectory was in its tool call); `capacity()` reports
  live KV use like SGLang's /v1/loads. Time advances in segments of whole steps between events (a
  request finishing, the pool filling, an arrival that can be admitted), not token by token.
- Workload: multi-turn trajectories with long-tailed lengths, observation sizes and tool latencies
  (see `paper_workload` for the figures and assumptions), groups of 2G = 32 rollouts per prompt.
- Policies: `static` (RoundRobinScheduler, all trajectories submitted at once, tool calls as soon as
  a turn ends), `static-sync` (the same placement with a per-turn barrier per engine: the verl v0.2
  baseline the paper measured) and `dynamic` (KvScheduler as the rollout loop drives it: a session
  per trajectory, a turn at a time; `--reservation worst-case` for the paper's worst-case rule).

Scales:
- `--scale small` mirrors `benchmarks/rollout_balance.py` (2 servers, its slots, pools and workload
  generator, the cpu-tiny cost profile) and prints the real engines' makespans from RESULTS.md beside
  the prediction.
- `--scale paper`: 512 prompts x 32 rollouts, 64 engines (the paper's 64 GPUs, one engine each;
  `--tp 4 --engines 16` for the release's tensor-parallel size on as many GPUs), Qwen3-14B on H100
  (`--profile mi300x-qwen3-14b` for the paper's GPUs), budget 8K and T = 10 (`--budget 12288` for
  stage 2, and `--max-turns 15` for stage 3).
- `--scale tiny`: a few trajectories on 2 engines (tests).
- `--calibrate` measures the JaxEngine (tiny preset, two `rstar_jax.serve` servers as
  rollout_balance.py runs them) and prints the fitted cpu-tiny coefficients.

The last line is `dynamic_vs_static=X.XX dynamic_vs_static_sync=Y.YY` (static makespan / dynamic).

    python benchmarks/rollout_sim.py --scale small [--slots 16,16 --pool 4096]
    python benchmarks/rollout_sim.py --scale paper [--engines 64 --budget 8192 --profile h100-qwen3-14b]
    python benchmarks/rollout_sim.py --calibrate
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import heapq
import importlib.util
import itertools
import math
import os
import selectors
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rstar_jax.rollout.protocol import (  # noqa: E402
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Capacity,
    GenerateResult,
    RequestRejected,
    SamplingParams,
)
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler  # noqa: E402

POLICIES = ("static", "static-sync", "dynamic")


# -- virtual time --------------------------------------------------------------------------------
class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is pending: some awaited event can never happen."""


class _VirtualSelector(selectors.BaseSelector):
    """A selector with no I/O: waiting `timeout` seconds moves the loop's clock by that much at once.

    The loop registers only its self-pipe here; a simulation performs no I/O, so nothing is ever ready."""

    def __init__(self, advance: Callable[[float], None]):
        self._advance = advance
        self._keys: dict[int, selectors.SelectorKey] = {}

    @staticmethod
    def _fd(fileobj) -> int:
        return fileobj if isinstance(fileobj, int) else fileobj.fileno()

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, self._fd(fileobj), events, data)
        if key.fd in self._keys:
            raise KeyError(f"{fileobj!r} is already registered")
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj):
        return self._keys.pop(self._fd(fileobj))

    def select(self, timeout=None):
        if timeout is None:  # the loop would block forever: nothing scheduled, nothing ready
            raise SimulationStalled("the simulation stalled: no callback is ready and no timer is pending")
        if timeout > 0:
            self._advance(timeout)
        return []

    def get_map(self):
        return self._keys

    def close(self):
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a simulated clock that starts at 0: when no callback is ready, the clock
    jumps to the next timer instead of sleeping. For simulations only (it performs no I/O)."""

    def __init__(self):
        self._virtual_now = 0.0
        super().__init__(selector=_VirtualSelector(self._advance_clock))

    def _advance_clock(self, seconds: float) -> None:
        self._virtual_now += seconds

    def time(self) -> float:
        return self._virtual_now


def run_virtual(coro):
    """Runs `coro` to completion on a fresh `VirtualTimeLoop`; returns its result."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


# -- cost model ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Profile:
    """An engine's cost model and defaults, in seconds and tokens.

    Decode step: step_s + step_per_request_s x running + step_per_kv_token_s x KV tokens read. An
    SGLang engine reads each running request's context (ragged paged attention); a `padded` engine
    (JaxEngine) runs all `max_running` rows at a fixed shape and attends over the span bucket of its
    longest context (max_length/8, /4, /2 or all), so it reads max_running x span.
    Prefill call: prefill_call_s + prefill_per_token_s x tokens + prefill_per_token_position_s x
    (token x its attention length), per chunk of `chunked_prefill` tokens (SGLang), or per group
    of `prefill_batch` padded rows x the prompt bucket, attending over the span bucket (JaxEngine).
    """

    name: str
    step_s: float
    step_per_request_s: float
    step_per_kv_token_s: float
    prefill_call_s: float
    prefill_per_token_s: float
    prefill_per_token_position_s: float
    request_latency_s: float  # client <-> server per generate call (HTTP), outside the engine
    pool_tokens: int  # max_total_num_tokens
    max_running: int  # max_running_requests (JaxEngine: slots)
    context_length: int
    page_size: int = 1  # KV page; a running request wastes half a page on average
    chunked_prefill: int = 8192
    padded: bool = False
    prefill_batch: int = 8
    retract_headroom_steps: int = 20  # retract until the survivors have this many steps of room
    clip_max_new_tokens: int | None = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    source: str = ""

    def decode_time(self, running: int, kv_read: int) -> float:
        return self.step_s + self.step_per_request_s * running + self.step_per_kv_token_s * kv_read


# cpu-tiny: the tiny preset on this machine's two cores, one XLA thread per server, two servers
# busy at once (as rollout_balance.py runs them), measured through HTTP. Measured 2026-11-24 08:31
# UTC (load average 0.9 before the run) with
#   JAX_PLATFORMS=cpu python benchmarks/rollout_sim.py --calibrate
# (see calibrate(): decode 0.72-1.10 ms/step at span 128, 1.32-1.47 at 256, 2.00-2.51 at 1024 for
# 1-16 running; 1-token requests 2.6, 4.0, 18.1 and 74.6 ms at prompt buckets 64-1024). A
# tiny-model prefill is attention-bound, hence the per-token-position term. Under the load of
# other jobs the same command gave steps and prefills up to 2x slower: calibrate on a quiet machine.
CPU_TINY = Profile(
    name="cpu-tiny",
    step_s=0.582e-3, step_per_request_s=24.5e-6, step_per_kv_token_s=9.34e-8,
    prefill_call_s=0.582e-3, prefill_per_token_s=0.0, prefill_per_token_position_s=5.49e-8,
    request_latency_s=1.12e-3,
    pool_tokens=4096, max_running=16, context_length=1024, page_size=16, padded=True, prefill_batch=8,
    retract_headroom_steps=1,  # JaxEngine retracts only what the next step needs
    clip_max_new_tokens=None,  # JaxEngine estimates with the whole remaining budget
    source="JaxEngine tiny preset on the 2-core CPU dev machine (rollout_sim.py --calibrate, 2026-11-24)",
)

# Qwen3-14B (HF config.json): 40 layers, 8 KV heads x 128, bf16, 14.8B parameters of which the
# 151936 x 5120 input embedding is gathered, not read, per decode step.
QWEN3_14B_PARAMS = 14.8e9
QWEN3_14B_KV_BYTES_PER_TOKEN = 2 * 40 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16
QWEN3_14B_WEIGHT_BYTES = QWEN3_14B_PARAMS * 2
QWEN3_14B_DECODE_READ_BYTES = (QWEN3_14B_PARAMS - 151936 * 5120) * 2
QWEN3_14B_FLOPS_PER_TOKEN = 2 * QWEN3_14B_PARAMS
QWEN3_14B_ATTN_FLOPS_PER_POSITION = 4 * 40 * 40 * 128  # QK^T and AV: 2 x 2 x layers x q heads x head_dim

# Published decode figures for Qwen3-14B, bf16, one H100, TP=1 (vLLM): the ML.ENERGY Leaderboard
# data, github.com/ml-energy/leaderboard public/data/tasks/{lm-arena-chat,gpqa}.json at commit
# 0cd52da: median inter-token latency (= decode step time) at a steady batch (max_num_seqs). The
# mean KV context per running request is prompt + E[L^2] / (2 E[L]) from the published output
# length histograms (about 590 tokens for lm-arena-chat, 4400 for gpqa) plus an assumed 250-token
# prompt: 840 and 4650 tokens.
H100_QWEN3_14B_ITL = (  # (running requests, mean context, median ITL ms)
    (8, 840, 12.54), (16, 840, 13.34), (32, 840, 15.01), (64, 840, 18.94), (96, 840, 23.50),
    (128, 840, 26.16), (192, 840, 33.37), (256, 840, 38.40),
    (8, 4650, 14.42), (16, 4650, 17.34), (32, 4650, 21.55), (59, 4650, 28.07),
)


def fit_relative(rows: Sequence[Sequence[float]], values: Sequence[float]) -> list[float]:
    """Least squares in relative error (each row scaled by 1 / its value), so short steps and
    prefills count as much as long ones."""
    values = np.asarray(values, float)
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float) / values[:, None], np.ones_like(values), rcond=None)
    return [float(x) for x in coef]


def fit_decode(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(a, b, c) of step = a + b x running + c x kv_read over (running, kv_read, step) points."""
    a, b, c = fit_relative([[1.0, r, kv] for r, kv, _ in points], [s for *_, s in points])
    return a, b, c


H100_STEP = fit_decode([(r, r * ctx, ms * 1e-3) for r, ctx, ms in H100_QWEN3_14B_ITL])


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: float
    bandwidth: float  # achieved HBM bytes/s
    bf16_flops: float  # dense peak
    chunked_prefill: int  # SGLang's default chunked_prefill_size for this memory size


# H100 SXM 80 GB: 2.95 TB/s is the HBM copy bandwidth measured on one H100 (the figure
# benchmarks/decode_throughput.py uses; 3.35 TB/s peak), 989 TFLOPS dense bf16.
H100 = Gpu("h100", 80 * 2**30, 2.95e12, 989e12, 8192)
# MI300X 192 GB: 5.3 TB/s peak, taken at the same achieved share of peak as the H100 (2.95 / 3.35),
# 1307 TFLOPS dense bf16. No published Qwen3-14B decode figures for it were found; its profile is
# the H100 fit with the bandwidth-bound terms scaled by bandwidth and the per-request term by FLOPS.
MI300X = Gpu("mi300x", 192 * 2**30, 5.3e12 * 2.95 / 3.35, 1307e12, 16384)
MEM_FRACTION_STATIC = 0.8  # verl's gpu_memory_utilization in the rStar2 release (spec §4.2)
PREFILL_MFU = 0.6  # share of dense bf16 peak a prefill reaches (assumed)
ALLREDUCE_S_PER_STEP = 80 * 15e-6  # TP > 1: two all-reduces per layer, ~15 us each (assumed)


def qwen3_14b_profile(gpu: Gpu, tp: int = 1) -> Profile:
    """Qwen3-14B on one engine of `tp` GPUs: the H100 fit's weight-read, per-request and KV terms
    scaled to `gpu` and split over `tp` GPUs; the pool is what mem_fraction_static leaves of `tp`
    GPUs' memory after the weights."""
    a, b, c = H100_STEP
    overhead = a - QWEN3_14B_DECODE_READ_BYTES / H100.bandwidth  # scheduling, sampling, launches
    weights = QWEN3_14B_DECODE_READ_BYTES / (gpu.bandwidth * tp)
    step_s = overhead + weights + (ALLREDUCE_S_PER_STEP if tp > 1 else 0.0)
    pool = int((tp * gpu.hbm_bytes * MEM_FRACTION_STATIC - QWEN3_14B_WEIGHT_BYTES) / QWEN3_14B_KV_BYTES_PER_TOKEN)
    flops = PREFILL_MFU * gpu.bf16_flops * tp
    return Profile(
        name=f"{gpu.name}-qwen3-14b" + (f"-tp{tp}" if tp > 1 else ""),
        step_s=step_s,
        step_per_request_s=b * H100.bf16_flops / (gpu.bf16_flops * tp),
        step_per_kv_token_s=c * H100.bandwidth / (gpu.bandwidth * tp),
        prefill_call_s=step_s,  # a prefill forward reads every weight once, as a decode step does
        prefill_per_token_s=QWEN3_14B_FLOPS_PER_TOKEN / flops,
        prefill_per_token_position_s=QWEN3_14B_ATTN_FLOPS_PER_POSITION / flops,
        request_latency_s=3e-3,  # an HTTP round trip to a local SGLang server (assumed)
        pool_tokens=pool,
        max_running=1024,  # SGLang's default is larger; KV is what binds at these pool sizes
        context_length=40960,
        chunked_prefill=gpu.chunked_prefill,
        source=("decode fitted to the ML.ENERGY H100 Qwen3-14B ITL table"
                + (" and scaled to MI300X by bandwidth and FLOPS" if gpu is not H100 else "")
                + f"; pool = ({tp} x {gpu.hbm_bytes / 2**30:.0f} GiB x {MEM_FRACTION_STATIC} - weights) / KV bytes"),
    )


PROFILES: dict[str, Callable[[int], Profile]] = {
    "cpu-tiny": lambda tp: CPU_TINY,
    "h100-qwen3-14b": lambda tp: qwen3_14b_profile(H100, tp),
    "mi300x-qwen3-14b": lambda tp: qwen3_14b_profile(MI300X, tp),
}

# SGLang's admission estimate (the same constants as rstar_jax.engine.jax_engine): new_token_ratio
# starts at SGLANG_INIT_NEW_TOKEN_RATIO 0.7 and decays linearly to 0.14 x that in 600 steps; after
# a retraction it is reset to (decoded + 20 x running) / their max_new_tokens.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.7 * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20
RATIO_RECHECK_STEPS = 16  # while the ratio decays, a blocked queue head is re-examined this often
JAX_PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # train.builders


# -- the simulated engine ------------------------------------------------------------------------
class SimTokens(Sequence):
    """Token ids standing in for a real context of `len` tokens (their values are irrelevant here).

    `owner` names the trajectory (prefix-cache identity: a context of the same owner extends the
    previous one); `next_turn` is how many tokens the simulated policy generates from this context
    before its stop token (None: until max_new_tokens)."""

    __slots__ = ("owner", "length", "next_turn")
    TOKEN = 1

    def __init__(self, owner: str | None, length: int, next_turn: int | None = None):
        self.owner, self.length, self.next_turn = owner, int(length), next_turn

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.TOKEN] * len(range(*index.indices(self.length)))
        if not -self.length <= index < self.length:
            raise IndexError(index)
        return self.TOKEN


WAITING, PREFILLING, RUNNING, DONE = range(4)


class _Request:
    __slots__ = ("rid", "owner", "prompt", "produce", "reason", "max_new", "future", "generated", "start_step",
                 "kv_at_start", "finish_step", "retractions", "cached", "state", "seq", "hit", "ended")

    def __init__(self, rid, owner, prompt, produce, reason, max_new, future, seq):
        self.rid, self.owner, self.prompt, self.produce, self.reason = rid, owner, prompt, produce, reason
        self.max_new, self.future, self.seq = max_new, future, seq
        self.generated = 0  # output tokens as of start_step (exact while not running)
        self.start_step = self.kv_at_start = self.finish_step = 0
        self.retractions = self.cached = self.hit = 0
        self.state = WAITING
        self.ended = False


class SimEngine:
    """A simulated SGLang-like engine; implements `rstar_jax.rollout.protocol.Generator`.

    pool_tokens / max_running / context_length default to the profile's. The simulated policy's
    turn lengths come from the `SimTokens` contexts it is given (plain token lists generate until
    max_new_tokens). Counters: retractions, generated_tokens, prefill_tokens, cached_tokens, steps,
    idle_s (time with nothing running or prefilling), peak_running."""

    def __init__(self, name: str, profile: Profile, *, pool_tokens: int | None = None, max_running: int | None = None,
                 context_length: int | None = None, prefix_cache: bool = True):
        self.name = name
        self.profile = profile
        self.pool = int(pool_tokens or profile.pool_tokens)
        self.max_running = int(max_running or profile.max_running)
        self.context_length = int(context_length or profile.context_length)
        self.prefix_cache = prefix_cache
        self._frag = profile.page_size // 2
        if profile.padded:
            pages = -(-self.context_length // profile.page_size)
            self._spans = sorted({-(-pages // d) * profile.page_size for d in (8, 4, 2, 1)})
            self._buckets = sorted({b for b in JAX_PREFILL_BUCKETS if b < self.context_length} | {self.context_length})
        self._waiting: collections.deque[_Request] = collections.deque()
        self._retracted: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}
        self._finishing: list[tuple[int, int, _Request]] = []  # (finish step, seq, request), lazily pruned
        self._longest: list[tuple[int, int, _Request]] = []  # padded: (-(kv_at_start - start_step), seq, request)
        self._prefilling: list[_Request] = []
        self._cache: collections.OrderedDict[str, int] = collections.OrderedDict()  # owner -> KV tokens, LRU first
        self._cached = 0
        self._step = 0
        self._kv = 0  # tokens held by running and prefilling requests (with their page waste)
        self._ratio = INIT_NEW_TOKEN_RATIO
        self._aborts: list[str] = []
        self._ended = False  # some caller went away since the last step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._soon = False
        self._phase = "idle"  # idle | prefill | decode
        self._seg = (0.0, 0, 0.0, 0.0)  # decode segment: (start time, steps, first step's cost, cost growth per step)
        self._idle_since = 0.0
        self._seq = itertools.count()
        self._rids = itertools.count()
        self.retractions = self.generated_tokens = self.prefill_tokens = self.cached_tokens = self.steps = 0
        self.idle_s = self.prefill_s = 0.0
        self.peak_running = 0

    # -- Generator protocol ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        return 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams,
                       rid: str | None = None) -> GenerateResult:
        latency = self.profile.request_latency_s / 2
        if latency:
            await asyncio.sleep(latency)
        self._loop = self._loop or asyncio.get_running_loop()
        context = len(input_ids)
        if context < 1:
            raise ValueError("generate: input_ids must be non-empty")
        longest = min(self.context_length, self.pool)  # SGLang's max_req_len: one request fits the pool
        if context >= longest:
            raise RequestRejected(f"{self.name}: context of {context} tokens does not fit "
                                  f"(context length {self.context_length}, pool {self.pool})")
        limit = min(sampling.max_new_tokens, longest - context)
        target = getattr(input_ids, "next_turn", None)
        produce, reason = (target, FINISH_STOP) if target is not None and target <= limit else (limit, FINISH_LENGTH)
        request = _Request(rid or f"{next(self._rids):016x}", getattr(input_ids, "owner", None), context,
                           max(1, produce), reason, sampling.max_new_tokens, self._loop.create_future(),
                           next(self._seq))
        head = not self._waiting and not self._retracted
        self._waiting.append(request)
        self._kick(head and self._may_admit(request))
        try:
            result = await request.future
        except asyncio.CancelledError:
            request.ended = self._ended = True  # the caller went away: free its KV at the next step
            self._kick(True)
            raise
        if latency:
            await asyncio.sleep(latency)
        return result

    async def capacity(self) -> Capacity:
        return Capacity(total_tokens=self.pool, used_tokens=self.live_kv(), running_requests=self.running,
                        queued_requests=self.queued, retracted_requests=len(self._retracted))

    async def abort(self, rid: str) -> None:
        """Aborts requests whose rid starts with `rid` (SGLang's prefix semantics); "" is ignored."""
        if rid:
            self._loop = self._loop or asyncio.get_running_loop()
            self._aborts.append(rid)
            self._kick(True)

    # -- observation ------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._retracted)

    def live_kv(self) -> int:
        """KV tokens in use now (SGLang's num_used_tokens: the prefix cache excluded)."""
        if self._phase != "decode":
            return self._kv
        return self._kv + len(self._running) * self._completed_steps(self._loop.time() - self._seg[0])

    def finish_idle(self, now: float) -> None:
        """Closes an open idle interval at `now` (the end of the simulation)."""
        if self._phase == "idle":
            self.idle_s += now - self._idle_since
            self._idle_since = now

    # -- engine loop ------------------------------------------------------------------------------
    def _may_admit(self, request: _Request) -> bool:
        """A cheap necessary condition for admitting `request` now (worth interrupting a decode run)."""
        return self.running < self.max_running and request.prompt + self._frag <= self.pool - self.live_kv()

    def _kick(self, urgent: bool) -> None:
        """New work: an idle engine starts at once; a decoding one stops at its next step boundary
        when `urgent` (an admissible arrival or an abort), as SGLang's loop looks at its queue every step."""
        if self._phase == "idle":
            if not self._soon:
                self._soon = True
                self._loop.call_soon(self._advance)
        elif self._phase == "decode" and urgent:
            start, steps, first, growth = self._seg
            done = self._completed_steps(self._loop.time() - start)
            if done + 1 < steps:
                self._handle.cancel()
                self._seg = (start, done + 1, first, growth)
                self._handle = self._loop.call_at(start + self._segment_time(done + 1), self._advance)

    def _segment_time(self, steps: int) -> float:
        _, _, first, growth = self._seg
        return steps * first + growth * steps * (steps - 1) / 2

    def _completed_steps(self, elapsed: float) -> int:
        """Whole steps of the current segment finished `elapsed` seconds after it started."""
        _, steps, first, growth = self._seg
        if growth > 0:
            # growth/2 m^2 + (first - growth/2) m - elapsed <= 0
            half = growth / 2
            lin = first - half
            m = int((-lin + math.sqrt(lin * lin + 4 * half * max(elapsed, 0.0))) / (2 * half))
        else:
            m = int(max(elapsed, 0.0) / first)
        m = max(0, min(m, steps))
        while m > 0 and self._segment_time(m) > elapsed:
            m -= 1
        while m < steps and self._segment_time(m + 1) <= elapsed:
            m += 1
        return m

    def _advance(self) -> None:
        self._soon = False
        self._handle = None
        now = self._loop.time()
        if self._phase == "decode":
            self._settle(self._seg[1])
        elif self._phase == "prefill":
            self._start_prefilled()
        else:
            self.idle_s += now - self._idle_since
        self._complete_finished()
        if self._aborts or self._ended:
            self._apply_aborts()
        self._plan(now)

    def _plan(self, now: float) -> None:
        admitted = self._admit()
        if admitted:
            self._phase = "prefill"
            self._prefilling = admitted
            duration = self._prefill_time(admitted)
            self.prefill_s += duration
            self._handle = self._loop.call_at(now + duration, self._advance)
            return
        while self._running:
            steps = self._steps_to_event()
            if steps == 0:  # the next step does not fit in the pool
                self._retract()
                continue
            running = len(self._running)
            if self.profile.padded:
                first, growth = self.profile.decode_time(running, self.max_running * self._span()), 0.0
            else:
                first = self.profile.decode_time(running, self._kv)
                growth = self.profile.step_per_kv_token_s * running
            self._phase = "decode"
            self._seg = (now, steps, first, growth)
            self._handle = self._loop.call_at(now + self._segment_time(steps), self._advance)
            return
        self._phase = "idle"
        self._idle_since = now

    def _steps_to_event(self) -> int:
        """Decode steps until the next event: a request finishes, the pool fills, the span bucket
        changes (padded), or (while the admission ratio still decays) a blocked head is looked at again."""
        while self._finishing and not self._current(self._finishing[0]):
            heapq.heappop(self._finishing)
        running = len(self._running)
        steps = self._finishing[0][0] - self._step
        if running > 1:  # cached prefixes are evicted before any running request is retracted
            steps = min(steps, (self.pool - self._kv) // running)
        if (self._waiting or self._retracted) and self._ratio > MIN_NEW_TOKEN_RATIO and running < self.max_running:
            steps = min(steps, RATIO_RECHECK_STEPS)
        if self.profile.padded:
            steps = min(steps, max(1, self._span() - self._longest_context() + 1))
        return max(0, steps)

    @staticmethod
    def _current(entry: tuple[int, int, _Request]) -> bool:
        """A finish-heap entry still describes its request (not one retracted or readmitted since)."""
        return entry[2].state == RUNNING and entry[2].finish_step == entry[0]

    def _settle(self, steps: int) -> None:
        running = len(self._running)
        self._step += steps
        self.steps += steps
        self._kv += running * steps
        self.generated_tokens += running * steps
        self._ratio = max(MIN_NEW_TOKEN_RATIO, self._ratio - NEW_TOKEN_RATIO_DECAY * steps)
        self._evict()

    def _evict(self) -> None:
        """Drops cached prefixes, least recently cached first, until they fit beside the running KV."""
        while self._cached and self._kv + self._cached > self.pool:
            _, tokens = self._cache.popitem(last=False)
            self._cached -= tokens

    def _generated(self, request: _Request) -> int:
        return request.generated + (self._step - request.start_step if request.state == RUNNING else 0)

    def _held(self, request: _Request) -> int:
        return request.kv_at_start + self._step - request.start_step

    def _remaining(self, request: _Request) -> int:
        """SGLang's estimate of the tokens a request may still generate."""
        generated = self._generated(request)
        left = min(request.max_new - generated, self.context_length - request.prompt - generated)
        clip = self.profile.clip_max_new_tokens
        return max(0, left if clip is None else min(left, clip))

    def _admit(self) -> list[_Request]:
        """Admits from the queue (retracted requests first) in order while SGLang's estimate fits."""
        if not (self._waiting or self._retracted) or self.running >= self.max_running:
            return []
        ratio = self._ratio
        reserved = ratio * sum(self._remaining(r) for r in self._running.values())
        available = self.pool - self._kv  # cached prefixes are evictable
        admitted = []
        while (self._retracted or self._waiting) and self.running + len(admitted) < self.max_running:
            source = self._retracted or self._waiting
            request = source[0]
            context = request.prompt + request.generated
            estimate = ratio * self._remaining(request)
            if (self._running or admitted) and context + self._frag + estimate > available - reserved:
                break  # first come, first served: nothing overtakes the head of the queue
            source.popleft()
            hit = 0
            if self.prefix_cache and request.owner is not None and request.generated == 0:
                cached = self._cache.pop(request.owner, 0)
                self._cached -= cached
                hit = min(cached, context - 1)
                request.cached = hit
                self.cached_tokens += hit
            request.hit = hit
            request.state = PREFILLING
            self._kv += context + self._frag
            available -= context + self._frag
            reserved += estimate
            self._evict()
            admitted.append(request)
        return admitted

    def _prefill_time(self, requests: list[_Request]) -> float:
        p = self.profile
        news = [r.prompt + r.generated - r.hit for r in requests]
        self.prefill_tokens += sum(news)
        if p.padded:  # JaxEngine: groups of prefill_batch rows (one row alone), padded to the prompt bucket
            total = 0.0
            for i in range(0, len(news), p.prefill_batch):
                group = news[i:i + p.prefill_batch]
                rows = 1 if len(group) == 1 else p.prefill_batch
                bucket = next(b for b in self._buckets if b >= max(group))
                span = self._span_for(max(r.prompt + r.generated for r in requests[i:i + p.prefill_batch]))
                total += (p.prefill_call_s + p.prefill_per_token_s * rows * bucket
                          + p.prefill_per_token_position_s * rows * bucket * span)
            return total
        tokens = sum(news)
        positions = sum(n * (r.hit + n / 2) for n, r in zip(news, requests))
        return (math.ceil(tokens / p.chunked_prefill) * p.prefill_call_s + p.prefill_per_token_s * tokens
                + p.prefill_per_token_position_s * positions)

    def _start_prefilled(self) -> None:
        """The prefill sampled each request's next token; those not done join the decode batch."""
        for request in self._prefilling:
            request.generated += 1
            self.generated_tokens += 1
            request.start_step = self._step
            request.kv_at_start = request.prompt + request.generated - 1
            request.state = RUNNING
            self._running[request.seq] = request
            if request.generated >= request.produce:
                self._finish(request, request.reason)
                continue
            request.finish_step = self._step + request.produce - request.generated
            heapq.heappush(self._finishing, (request.finish_step, request.seq, request))
            if self.profile.padded:
                heapq.heappush(self._longest, (-(request.kv_at_start - request.start_step), request.seq, request))
        self._prefilling = []
        self.peak_running = max(self.peak_running, len(self._running))

    def _complete_finished(self) -> None:
        while self._finishing and self._finishing[0][0] <= self._step:
            entry = heapq.heappop(self._finishing)
            if self._current(entry):
                self._finish(entry[2], entry[2].reason)

    def _finish(self, request: _Request, reason: str) -> None:
        """Ends a running request: its KV stays behind as its owner's cached prefix."""
        generated = self._generated(request)
        held = self._held(request)
        del self._running[request.seq]
        request.state = DONE
        self._kv -= held + self._frag
        if self.prefix_cache and request.owner is not None:
            self._cached -= self._cache.pop(request.owner, 0)
            self._cache[request.owner] = held
            self._cached += held
            self._evict()
        self._resolve(request, generated, reason)

    def _resolve(self, request: _Request, generated: int, reason: str) -> None:
        if not request.future.done():
            request.future.set_result(GenerateResult(
                [SimTokens.TOKEN] * generated, [0.0] * generated, reason, 0,
                num_retractions=request.retractions, cached_tokens=request.cached))

    def _retract(self) -> None:
        """SGLang's retract_decode: frees the requests with the fewest output tokens (then the
        longest prompt), at least one, until the rest have `retract_headroom_steps` steps of room;
        they go back to the front of the queue and are prefilled again on readmission. The ratio is
        reset to the survivors' share of their budget decoded so far."""
        order = sorted(self._running.values(), key=lambda r: (self._generated(r), -r.prompt), reverse=True)
        need = self.profile.retract_headroom_steps
        first = True
        while len(order) > 1 and (first or self.pool - self._kv < need * len(order)):
            first = False
            victim = order.pop()
            victim.generated = self._generated(victim)
            self._kv -= self._held(victim) + self._frag
            del self._running[victim.seq]
            victim.state = WAITING
            victim.hit = 0
            victim.retractions += 1
            self.retractions += 1
            self._retracted.appendleft(victim)
        decoded = sum(self._generated(r) for r in order) + RETRACT_DECODE_STEPS * len(order)
        self._ratio = min(1.0, decoded / max(1, sum(r.max_new for r in order)))

    def _apply_aborts(self) -> None:
        prefixes = tuple(self._aborts)
        self._aborts, self._ended = [], False

        def hit(request: _Request) -> bool:
            return request.ended or (bool(prefixes) and request.rid.startswith(prefixes))

        for request in [r for r in self._running.values() if hit(r)]:
            self._finish(request, FINISH_ABORT)
        for queue in (self._retracted, self._waiting):
            for request in [r for r in queue if hit(r)]:
                queue.remove(request)
                request.state = DONE
                self._resolve(request, request.generated, FINISH_ABORT)

    def _span(self) -> int:
        return self._span_for(self._longest_context())

    def _span_for(self, context: int) -> int:
        """The attention span a padded engine reads for a longest context of `context` tokens."""
        return next((s for s in self._spans if s >= context), self._spans[-1])

    def _longest_context(self) -> int:
        while self._longest and not (self._longest[0][2].state == RUNNING and -self._longest[0][0]
                                     == self._longest[0][2].kv_at_start - self._longest[0][2].start_step):
            heapq.heappop(self._longest)
        return -self._longest[0][0] + self._step if self._longest else 0


# -- workload ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrajectoryPlan:
    """What the simulated policy will do in one trajectory."""

    tid: str
    prompt: int  # prompt tokens (chat template and tools block included)
    turns: tuple[int, ...]  # tokens generated per assistant turn, up to its stop token; the last answers
    observations: tuple[int, ...]  # tool-response tokens appended after each non-final turn
    tool_latency: tuple[float, ...]  # seconds per tool call, after each non-final turn
    group: int = 0

    @property
    def intended(self) -> int:
        """Response tokens (model and tool) if the budget were unlimited."""
        return sum(self.turns) + sum(self.observations)


# rStar2-Agent's rollout figures (spec §3.1, §5.3; PAPER §3.1, §4.3) and what is assumed where the
# paper gives none:
# - 512 prompts x 32 rollouts per step, at most T = 10 turns (stages 1-2; 15 in stage 3).
# - Response length (model + tool tokens): mean about 4K at the end of stage 1 (8K budget) and 6K at
#   the end of stage 2 (12K), with "more than 10%" truncated at times: a lognormal with 10% of its
#   mass above the budget and the given mean after truncation. Assumed: 40% of its log-variance is
#   per prompt (problem difficulty), 60% per rollout.
# - Tool calls: "up to 45K" per step at 0.3 s mean end-to-end latency, scheduling included. The
#   45K is taken as the mean, 45K / 16384 = 2.75 calls per trajectory, more in longer ones (Poisson
#   with a mean proportional to the length, at most T - 1; assumed). Latency lognormal with mean 0.3 s and sigma 1.0, cut at
#   5 s (the release's 4 s execution limit + 1 s to kill; the shape is assumed).
# - Observation: the release cuts tool output to 256 characters (spec §2.3): assumed lognormal with
#   median 40 tokens, at most 100, plus 15 tokens of wrapper (<|im_start|>user ... <reason>).
# - Prompt: assumed lognormal with median 550 tokens (system prompt, tools block and question),
#   250-2048 (max prompt length 2048).
TOOL_CALLS_PER_TRAJECTORY = 45_000 / (512 * 32)
TOOL_LATENCY_MEAN_S = 0.3
TOOL_LATENCY_SIGMA = 1.0
TOOL_LATENCY_MAX_S = 5.0
OBSERVATION_WRAPPER = 15
OBSERVATION_MEDIAN, OBSERVATION_SIGMA, OBSERVATION_MAX = 40, 0.7, 100
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX = 550, 0.25, 250, 2048
PROMPT_SHARE_OF_LOG_VARIANCE = 0.4


def response_lognormal(mean: float, budget: int, truncated: float) -> tuple[float, float]:
    """(mu, sigma) of a lognormal response length with `truncated` of its mass above `budget` whose
    mean after truncation at the budget is `mean`."""
    normal = statistics.NormalDist()
    z = normal.inv_cdf(1.0 - truncated)

    def realized(sigma: float) -> float:
        mu = math.log(budget) - z * sigma
        return math.exp(mu + sigma * sigma / 2) * normal.cdf(z - sigma) + budget * truncated

    lo, hi = 1e-3, 4.0  # realized() falls as sigma grows
    if not realized(hi) <= mean <= realized(lo):
        raise ValueError(f"--mean-length {mean:.0f} cannot be reached with {truncated:.0%} of responses above "
                         f"the {budget}-token budget (possible: {realized(hi):.0f}-{realized(lo):.0f})")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if realized(mid) > mean else (lo, mid)
    sigma = (lo + hi) / 2
    return math.log(budget) - z * sigma, sigma


def paper_workload(prompts: int, group: int, *, budget: int, max_turns: int, seed: int,
                   mean_length: float | None = None, truncated: float = 0.10) -> list[TrajectoryPlan]:
    """`prompts` x `group` trajectories with the paper's length, turn and tool figures (see above)."""
    rng = np.random.default_rng(seed)
    mu, sigma = response_lognormal(mean_length or 0.49 * budget, budget, truncated)
    n = prompts * group
    prompt_len = np.clip(np.rint(rng.lognormal(math.log(PROMPT_MEDIAN), PROMPT_SIGMA, prompts)),
                         PROMPT_MIN, PROMPT_MAX).astype(int)
    sigma_p = sigma * math.sqrt(PROMPT_SHARE_OF_LOG_VARIANCE)
    sigma_r = sigma * math.sqrt(1.0 - PROMPT_SHARE_OF_LOG_VARIANCE)
    groups = np.repeat(np.arange(prompts), group)
    length = np.exp(mu + sigma_p * rng.standard_normal(prompts)[groups] + sigma_r * rng.standard_normal(n))
    mean_length_untruncated = math.exp(mu + sigma * sigma / 2)
    calls = np.minimum(rng.poisson(TOOL_CALLS_PER_TRAJECTORY * length / mean_length_untruncated), max_turns - 1)
    total_calls = int(calls.sum())
    observations = OBSERVATION_WRAPPER + np.clip(np.rint(rng.lognormal(
        math.log(OBSERVATION_MEDIAN), OBSERVATION_SIGMA, total_calls)), 1, OBSERVATION_MAX).astype(int)
    latency_mu = math.log(TOOL_LATENCY_MEAN_S) - TOOL_LATENCY_SIGMA ** 2 / 2
    latencies = np.minimum(rng.lognormal(latency_mu, TOOL_LATENCY_SIGMA, total_calls), TOOL_LATENCY_MAX_S)
    shares = rng.exponential(1.0, total_calls + n)  # normalised per trajectory: Dirichlet(1, ..., 1) turn shares
    plans, call, share = [], 0, 0
    for i in range(n):
        k = int(calls[i])
        obs = observations[call:call + k]
        lat = latencies[call:call + k]
        w = shares[share:share + k + 1]
        call, share = call + k, share + k + 1
        model = int(length[i]) - int(obs.sum())
        while k and model < k + 1:  # too short for its calls: fewer calls
            k -= 1
            model += int(obs[k])
            obs, lat, w = obs[:k], lat[:k], w[:k + 1]
        turns = np.maximum(1, np.floor(w / w.sum() * max(model, 1))).astype(int)
        plans.append(TrajectoryPlan(f"{i:016x}", int(prompt_len[groups[i]]), tuple(int(t) for t in turns),
                                    tuple(int(o) for o in obs), tuple(float(x) for x in lat), int(groups[i])))
    return plans


def _rollout_balance():
    """benchmarks/rollout_balance.py as a module (benchmarks is not a package)."""
    name = "rollout_balance"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(__file__), "rollout_balance.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def small_workload(trajectories: int, *, budget: int, prompt_len: int, observation: int, turn_median: float,
                   tool_latency: float, seed: int) -> list[TrajectoryPlan]:
    """rollout_balance.py's workload, from its own generator, so both run the same trajectories."""
    work = _rollout_balance().make_workload(trajectories, budget=budget, prompt_len=prompt_len,
                                            observation=observation, vocab=320, seed=seed, turn_median=turn_median)
    return [TrajectoryPlan(f"{i:016x}", len(t.prompt), tuple(t.turns), (t.observation,) * (len(t.turns) - 1),
                           (tool_latency,) * (len(t.turns) - 1), i) for i, t in enumerate(work)]


# -- policies ------------------------------------------------------------------------------------
from rstar_jax.rollout.scheduler import RESERVATIONS  # noqa: E402


def kv_scheduler(generators: Sequence[SimEngine], budget_fraction: float, reservation: str = "expected") -> KvScheduler:
    return KvScheduler(generators, budget_fraction=budget_fraction, reservation=reservation)


@dataclasses.dataclass
class _Tally:
    finished: int = 0
    truncated: int = 0
    tokens: int = 0  # response tokens the policy sampled (recomputation not counted)
    request_retractions: int = 0
    tool_calls: int = 0


_rid_counter = itertools.count()


def _rid() -> str:
    return f"{next(_rid_counter):016x}"  # fixed width: SGLang aborts by rid prefix


async def _turn(gen, plan: TrajectoryPlan, k: int, response: int, *, budget: int, exact_max_new: bool,
                tally: _Tally) -> GenerateResult:
    """One assistant turn: max_new_tokens is the remaining budget (run_trajectory) or, mirroring
    rollout_balance.py, the turn's exact length."""
    length = plan.turns[k]
    sampling = SamplingParams(max_new_tokens=length if exact_max_new else budget - response)
    result = await gen.generate(SimTokens(plan.tid, plan.prompt + response, length), sampling, _rid())
    tally.tokens += len(result.token_ids)
    tally.request_retractions += result.num_retractions
    return result


def _continues(plan: TrajectoryPlan, k: int, result: GenerateResult, response: int, *, budget: int,
               exact_max_new: bool, tally: _Tally) -> bool:
    """Whether the turn's tool call runs (run_trajectory's stop rules); counts truncation."""
    if not exact_max_new and result.finish_reason == FINISH_LENGTH:
        tally.truncated += 1
        return False
    if k + 1 == len(plan.turns):
        return False  # the answer: no tool call
    if not exact_max_new and response + OBSERVATION_WRAPPER >= budget:
        tally.truncated += 1  # not even an empty observation fits
        return False
    return True


def _observe(plan: TrajectoryPlan, k: int, response: int, *, budget: int, exact_max_new: bool,
             tally: _Tally) -> int | None:
    """The response length after the tool's observation, or None when it would reach the budget."""
    tally.tool_calls += 1
    if not exact_max_new and response + plan.observations[k] >= budget:
        tally.truncated += 1
        return None
    return response + plan.observations[k]


async def run_session(plan: TrajectoryPlan, scheduler, *, budget: int, exact_max_new: bool, tally: _Tally) -> None:
    """A trajectory as run_trajectory drives it: a session for its life, a generator from it per
    turn, each tool call as soon as its turn ends."""
    async with scheduler.trajectory(plan.tid, group=plan.group) as session:
        response = 0
        for k in range(len(plan.turns)):
            max_new = plan.turns[k] if exact_max_new else budget - response
            async with session.turn(plan.prompt + response, max_new) as gen:
                result = await _turn(gen, plan, k, response, budget=budget, exact_max_new=exact_max_new, tally=tally)
                session.record(len(result.token_ids))
            response += len(result.token_ids)
            if not _continues(plan, k, result, response, budget=budget, exact_max_new=exact_max_new, tally=tally):
                break
            await asyncio.sleep(plan.tool_latency[k])
            response = _observe(plan, k, response, budget=budget, exact_max_new=exact_max_new, tally=tally)
            if response is None:
                break
    tally.finished += 1


async def run_turn_synchronous(gen, plans: Sequence[TrajectoryPlan], *, budget: int, exact_max_new: bool,
                               tally: _Tally) -> None:
    """The paper's baseline (verl v0.2) on one engine, as rollout_balance.py runs it: every live
    trajectory generates its turn, then all their tool calls run, then the next turn starts."""
    response = {p.tid: 0 for p in plans}
    live, k = list(plans), 0
    while live:
        results = await asyncio.gather(*(_turn(gen, p, k, response[p.tid], budget=budget, exact_max_new=exact_max_new,
                                               tally=tally) for p in live))
        calling = []
        for p, result in zip(live, results):
            response[p.tid] += len(result.token_ids)
            if _continues(p, k, result, response[p.tid], budget=budget, exact_max_new=exact_max_new, tally=tally):
                calling.append(p)
            else:
                tally.finished += 1
        live = []
        if calling:
            await asyncio.sleep(max(p.tool_latency[k] for p in calling))  # the batch's calls, in parallel
            for p in calling:
                after = _observe(p, k, response[p.tid], budget=budget, exact_max_new=exact_max_new, tally=tally)
                if after is None:
                    tally.finished += 1
                else:
                    response[p.tid] = after
                    live.append(p)
        k += 1


@dataclasses.dataclass
class PolicyResult:
    policy: str
    makespan: float  # simulated seconds until the last trajectory ended
    idle_fraction: float  # engine-time with nothing running or prefilling, before the makespan
    retractions: int
    queue_mean: float  # trajectories waiting to start + requests waiting in engine queues (sampled)
    queue_peak: int
    tokens: int
    finished: int
    truncated: int
    tool_calls: int
    prefill_tokens: int
    cached_tokens: int
    peak_running: list[int]
    placed: list[int]  # trajectories placed on each engine
    wall_s: float


def simulate(policy: str, plans: Sequence[TrajectoryPlan], engines: Sequence[tuple[int, int]], profile: Profile, *,
             budget: int, context_length: int | None = None, exact_max_new: bool = False,
             budget_fraction: float = 1.0, reservation: str = "expected",
             make_scheduler: Callable[..., object] = kv_scheduler,
             sample_interval: float = 1.0, reconcile_interval: float = 0.0) -> PolicyResult:
    """Runs every trajectory of `plans` under `policy` on engines of (pool tokens, max running) in
    virtual time. `make_scheduler(generators, budget_fraction, reservation)` builds the dynamic
    policy's scheduler over the simulated generators; `reconcile_interval` > 0
    calls the scheduler's `reconcile()` that often (simulated seconds)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")

    async def main() -> PolicyResult:
        loop = asyncio.get_running_loop()
        gens = [SimEngine(f"engine{i}", profile, pool_tokens=pool, max_running=slots, context_length=context_length)
                for i, (pool, slots) in enumerate(engines)]
        scheduler = (RoundRobinScheduler(gens) if policy == "static"
                     else make_scheduler(gens, budget_fraction, reservation) if policy == "dynamic" else None)
        tally, samples = _Tally(), []

        async def sample():
            while True:
                samples.append(sum(g.queued for g in gens) + getattr(scheduler, "queued", 0))
                await asyncio.sleep(sample_interval)

        async def reconcile():
            while True:
                await asyncio.sleep(reconcile_interval)
                await scheduler.reconcile()

        helpers = [asyncio.ensure_future(sample())]
        if policy == "dynamic" and reconcile_interval > 0:
            helpers.append(asyncio.ensure_future(reconcile()))
        if policy == "static-sync":
            await asyncio.gather(*(run_turn_synchronous(g, plans[i::len(gens)], budget=budget,
                                                        exact_max_new=exact_max_new, tally=tally)
                                   for i, g in enumerate(gens)))
        else:
            await asyncio.gather(*(run_session(p, scheduler, budget=budget, exact_max_new=exact_max_new,
                                               tally=tally) for p in plans))
        makespan = loop.time()
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        for g in gens:
            g.finish_idle(makespan)
        return PolicyResult(
            policy=policy, makespan=makespan,
            idle_fraction=sum(g.idle_s for g in gens) / (len(gens) * makespan) if makespan else 0.0,
            retractions=sum(g.retractions for g in gens), queue_mean=float(np.mean(samples)) if samples else 0.0,
            queue_peak=int(max(samples, default=0)), tokens=tally.tokens, finished=tally.finished,
            truncated=tally.truncated, tool_calls=tally.tool_calls, prefill_tokens=sum(g.prefill_tokens for g in gens),
            cached_tokens=sum(g.cached_tokens for g in gens), peak_running=[g.peak_running for g in gens],
            placed=(scheduler.admitted_per_generator() if scheduler is not None
                    else [len(plans[i::len(gens)]) for i in range(len(gens))]), wall_s=0.0)

    start = time.perf_counter()
    result = run_virtual(main())
    result.wall_s = time.perf_counter() - start
    if result.finished != len(plans):
        raise RuntimeError(f"{policy}: {result.finished} of {len(plans)} trajectories finished")
    return result


# -- calibration -----------------------------------------------------------------------------------
def calibrate(*, slots: int = 16, pool: int = 16384, max_length: int = 1024, servers: int = 2,
              repeats: int = 2) -> Profile:
    """Fits the cpu-tiny profile on this machine: `servers` tiny-preset `rstar_jax.serve` servers
    started as rollout_balance.py starts them (one XLA thread each), loaded identically at once.
    Decode: per-step time from runs of two lengths inside one attention span bucket, at 1 and
    `slots` requests per server, fitted to a + b x running + c x slots x span. Prefill and request
    latency: one 1-token request per server with prompts in 64-1024 token buckets, fitted to
    latency + a + p x bucket x span (the prefill call's fixed cost is taken equal to a decode step's)."""
    from rstar_jax.engine.local_server import LocalServer
    from rstar_jax.rollout.sglang import SGLangGenerator

    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    rng = np.random.default_rng(0)

    async def wall(gens, k: int, prompt: int, new: int) -> float:
        sampling = SamplingParams(max_new_tokens=new, temperature=1.0)
        start = time.perf_counter()
        await asyncio.gather(*(g.generate(rng.integers(1, 320, prompt).tolist(), sampling)
                               for g in gens for _ in range(k)))
        return time.perf_counter() - start

    async def best(gens, k, prompt, new) -> float:
        await wall(gens, k, prompt, new)  # compiles and warms this shape
        return min([await wall(gens, k, prompt, new) for _ in range(repeats)])

    async def measure(urls):
        gens = [SGLangGenerator(u) for u in urls]
        try:
            decode = []
            # (span, prompt, short run, long run): every context stays inside one span bucket
            for span, prompt, short, long in ((128, 70, 10, 50), (256, 140, 20, 100), (1024, 560, 60, 420)):
                for k in (1, slots):
                    step = ((await best(gens, k, prompt, long)) - (await best(gens, k, prompt, short))) / (long - short)
                    decode.append((k, slots * span, step))
                    print(f"  decode: {k:2d} running, span {span:4d}: {step * 1e3:.3f} ms/step", flush=True)
            a, b, c = fit_decode(decode)
            prefill = []
            for prompt in (40, 200, 480, 1000):
                bucket = next(x for x in JAX_PREFILL_BUCKETS if x >= prompt)
                span = max(bucket, max_length // 8)
                await wall(gens, 1, prompt, 1)
                seconds = statistics.median([await wall(gens, 1, prompt, 1) for _ in range(3 * repeats)])
                prefill.append((bucket * span, seconds))
                print(f"  1-token request, prompt bucket {bucket:4d}: {seconds * 1e3:.2f} ms", flush=True)
            fixed, per_position = fit_relative([[1.0, positions] for positions, _ in prefill], [s for _, s in prefill])
            return a, b, c, per_position, max(0.0, fixed - a)
        finally:
            for g in gens:
                await g.close()

    started = []
    try:
        for _ in range(servers):
            started.append(LocalServer("tiny", slots=slots, max_length=max_length, max_total_tokens=pool,
                                       page_size=16, seed=0, env=env).__enter__())
        a, b, c, per_position, latency = asyncio.run(measure([s.url for s in started]))
    finally:
        for s in started:
            s.__exit__(None, None, None)
    return dataclasses.replace(CPU_TINY, step_s=a, step_per_request_s=b, step_per_kv_token_s=c, prefill_call_s=a,
                               prefill_per_token_position_s=per_position, request_latency_s=latency,
                               source=f"calibrated now ({servers} servers, {slots} slots)")


# -- command line ----------------------------------------------------------------------------------
# Real-engine makespans of rollout_balance.py (2 servers), keyed by (slots, pools, trajectories,
# turn median), with the scheduler and engine at the commit named: benchmarks/RESULTS.md, "KV-aware
# scheduling turn by turn", workload seed 0 (earlier tables are in RESULTS.md).
REAL_MAKESPANS = {
    "0560f44": {  # seed 0, median of 3 rounds, 2026-11-24
        ((16, 16), (4096, 4096), 96, 40.0): {"static": 1.96, "static-sync": 4.18, "dynamic": 2.01},
        ((16, 16), (16384, 16384), 96, 40.0): {"static": 1.67, "static-sync": 3.09, "dynamic": 1.67},
        ((16, 4), (16384, 4096), 96, 40.0): {"static": 2.63, "static-sync": 3.16, "dynamic": 2.65},
        ((16, 16), (8192, 8192), 64, 250.0): {"static": 3.62, "static-sync": 6.00, "dynamic": 4.34},
    },
}

SCALES = {
    # rollout_balance.py's defaults
    "small": dict(profile="cpu-tiny", slots="16,16", pool="4096", trajectories=96, budget=768, prompt_len=32,
                  observation=16, turn_median=40.0, tool_latency=0.02, sample_interval=0.005),
    # the paper: 512 prompts x 32 rollouts on 64 GPUs (one engine each), stage 1's 8K budget, T = 10
    "paper": dict(profile="h100-qwen3-14b", engines=64, prompts=512, group=32, budget=8192, max_turns=10,
                  sample_interval=1.0),
    "tiny": dict(profile="h100-qwen3-14b", engines=2, prompts=4, group=8, budget=8192, max_turns=10,
                 sample_interval=1.0),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",")]


def build(args) -> tuple[list[TrajectoryPlan], list[tuple[int, int]], Profile, dict]:
    """The workload, the engines (pool, max running), the profile and simulate()'s options for `args`."""
    defaults = SCALES[args.scale]
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    profile = args.calibrated or PROFILES[args.profile](args.tp)
    if args.scale == "small":
        slots = _ints(args.slots)
        pools = _ints(args.pool)
        pools = pools * len(slots) if len(pools) == 1 else pools
        if len(pools) != len(slots):
            raise SystemExit(f"--pool has {len(pools)} values for {len(slots)} servers")
        context = 1 << (args.prompt_len + args.budget).bit_length()  # rollout_balance.py's max_length
        engines = [(pool or n * context, n) for n, pool in zip(slots, pools)]
        plans = small_workload(args.trajectories, budget=args.budget, prompt_len=args.prompt_len,
                               observation=args.observation, turn_median=args.turn_median,
                               tool_latency=args.tool_latency, seed=args.seed)
        options = dict(context_length=context, exact_max_new=True)
    else:
        if profile.context_length < PROMPT_MAX + args.budget:
            raise SystemExit(f"--profile {profile.name}: its context length {profile.context_length} cannot hold a "
                             f"{PROMPT_MAX}-token prompt and the {args.budget}-token budget (use a GPU profile)")
        pools = _ints(args.pool) if args.pool is not None else [profile.pool_tokens]
        pools = pools * args.engines if len(pools) == 1 else pools
        if len(pools) != args.engines:
            raise SystemExit(f"--pool has {len(pools)} values for {args.engines} engines")
        engines = [(pool, args.max_running or profile.max_running) for pool in pools]
        plans = paper_workload(args.prompts, args.group, budget=args.budget, max_turns=args.max_turns,
                               seed=args.seed, mean_length=args.mean_length, truncated=args.truncation)
        options = dict(exact_max_new=False)
    options.update(budget=args.budget, budget_fraction=args.budget_fraction, reservation=args.reservation,
                   sample_interval=args.sample_interval, reconcile_interval=args.reconcile_interval)
    return plans, engines, profile, options


def report(args, plans, engines, profile, results: dict[str, PolicyResult]) -> list[str]:
    """The lines main() prints; the last is the speed-up line."""
    lengths = sorted(min(p.intended, args.budget) for p in plans)
    calls = sum(len(p.observations) for p in plans)
    # prefilled: context tokens prefilled (prompts, observations and recomputation) per sampled token
    lines = [
        f"workload: {len(plans)} trajectories, response budget {args.budget}, planned response tokens "
        f"median {lengths[len(lengths) // 2]} mean {np.mean(lengths):.0f} max {lengths[-1]}, "
        f"{np.mean([len(p.turns) for p in plans]):.2f} turns and {calls / len(plans):.2f} tool calls per trajectory",
        f"engines: {len(engines)} x {profile.name} (pool, max running: "
        + ", ".join(f"{pool}/{slots}" for pool, slots in sorted(set(engines), reverse=True))
        + f"); step {profile.step_s * 1e3:.3g} ms + {profile.step_per_request_s * 1e3:.3g} ms/request + "
          f"{profile.step_per_kv_token_s * 1e9:.3g} ns/KV token; {profile.source}",
        f"{'policy':12s} {'makespan':>11s} {'idle':>6s} {'retractions':>11s} {'queue mean/peak':>16s} "
        f"{'tokens/s':>9s} {'prefilled':>9s} {'truncated':>9s} {'peak running':>13s} {'placed':>11s} {'wall':>7s}",
    ]
    for name, r in results.items():
        lines.append(f"{name:12s} {r.makespan:9.2f} s {r.idle_fraction:6.1%} {r.retractions:11d} "
                     f"{r.queue_mean:8.1f} / {r.queue_peak:<6d} {r.tokens / r.makespan:9.0f} "
                     f"{r.prefill_tokens / r.tokens:8.2f}x {r.truncated:9d} "
                     f"{min(r.peak_running):6d}-{max(r.peak_running):<6d} {min(r.placed):5d}-{max(r.placed):<5d} "
                     f"{r.wall_s:5.1f} s")
    if args.scale == "small":
        key = (tuple(_ints(args.slots)), tuple(e[0] for e in engines), args.trajectories, float(args.turn_median))
        same = (args.budget, args.prompt_len, args.observation, args.tool_latency, args.seed) == (768, 32, 16, 0.02, 0)
        rows = {label: table[key] for label, table in REAL_MAKESPANS.items() if same and key in table}
        for label, real in rows.items():
            lines.append(f"real engines (RESULTS.md, rollout_balance.py, {label}): " + ", ".join(
                f"{name} {real[name]:.2f} s (simulated {results[name].makespan:.2f} s, "
                f"{results[name].makespan / real[name] - 1:+.0%})" for name in results))
        if not rows:
            lines.append("real engines: RESULTS.md has no rollout_balance.py row for this setting")
    ratios = []
    if "dynamic" in results:
        for name, label in (("static", "dynamic_vs_static"), ("static-sync", "dynamic_vs_static_sync")):
            if name in results:
                ratios.append(f"{label}={results[name].makespan / results['dynamic'].makespan:.2f}")
    lines.append(" ".join(ratios))
    return lines


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="small")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--profile", choices=sorted(PROFILES), help="engine cost profile (default: the scale's)")
    parser.add_argument("--tp", type=int, default=1, help="GPUs per engine (tensor parallel) for the GPU profiles")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the cpu-tiny profile on this machine (real servers), print it, then "
                             "simulate --scale small with it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, help="response budget per trajectory (tokens)")
    parser.add_argument("--budget-fraction", type=float, default=1.0, help="KvScheduler's alpha")
    parser.add_argument("--reservation", choices=RESERVATIONS, default="expected",
                        help="what a turn reserves under the dynamic policy: its context plus the expected "
                             "output, or plus its whole max_new_tokens")
    parser.add_argument("--reconcile-interval", type=float, default=10.0,
                        help="simulated seconds between KvScheduler.reconcile() calls (0: never after the first)")
    parser.add_argument("--pool", help="KV pool tokens per engine, comma-separated (one value: every engine; "
                                       "small scale: 0 means slots x context)")
    parser.add_argument("--sample-interval", type=float, help="simulated seconds between queue samples")
    paper = parser.add_argument_group("paper and tiny scales")
    paper.add_argument("--engines", type=int)
    paper.add_argument("--prompts", type=int)
    paper.add_argument("--group", type=int, help="rollouts per prompt (2G)")
    paper.add_argument("--max-turns", type=int)
    paper.add_argument("--max-running", type=int, help="max running requests per engine")
    paper.add_argument("--mean-length", type=float, help="mean response tokens (default 0.49 x budget)")
    paper.add_argument("--truncation", type=float, default=0.10, help="share of responses longer than the budget")
    small = parser.add_argument_group("small scale (rollout_balance.py's flags)")
    small.add_argument("--slots", help="decode slots per server, comma-separated")
    small.add_argument("--trajectories", type=int)
    small.add_argument("--prompt-len", type=int)
    small.add_argument("--observation", type=int)
    small.add_argument("--turn-median", type=float)
    small.add_argument("--tool-latency", type=float)
    args = parser.parse_args(argv)
    args.calibrated = None
    if args.calibrate:
        if args.scale != "small":
            parser.error("--calibrate measures the cpu-tiny profile; it simulates --scale small")
        print("calibrating cpu-tiny: 2 tiny-preset servers, 16 slots, 16384-token pools, max length 1024", flush=True)
        args.calibrated = calibrate()
        p = args.calibrated
        print(f"cpu-tiny fitted: step_s={p.step_s:.3g}, step_per_request_s={p.step_per_request_s:.3g}, "
              f"step_per_kv_token_s={p.step_per_kv_token_s:.3g}, prefill_call_s={p.prefill_call_s:.3g}, "
              f"prefill_per_token_position_s={p.prefill_per_token_position_s:.3g}, "
              f"request_latency_s={p.request_latency_s:.3g}", flush=True)
    policies = args.policies.split(",")
    for name in policies:
        if name not in POLICIES:
            parser.error(f"--policies: {name!r} is not one of {POLICIES}")
    plans, engines, profile, options = build(args)
    results = {}
    for name in policies:
        results[name] = simulate(name, plans, engines, profile, **options)
    lines = report(args, plans, engines, profile, results)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
