"""Rollout makespan: KV-aware dynamic scheduling vs static round-robin over several engine servers.

Starts N `python -m rstar_jax.serve` servers (random-init preset) on loopback and replays one
long-tailed multi-turn workload twice over the same warm servers through the SGLang client:
once placed by `RoundRobinScheduler` (static: trajectory i -> server i mod N, all submitted at
once, servers queue them) and once by `KvScheduler` (admit on the server with the most free KV
budget when the trajectory's worst-case footprint fits, sticky, refill on release). The two
policies alternate for --repeats rounds; the median makespans and their ratio are printed.

`--slots 4,4` gives homogeneous servers; `--slots 6,2` servers of different capacity (as on a
cluster mixing GPU types or tensor-parallel sizes).

    python benchmarks/rollout_balance.py [--slots 4,4] [--trajectories 48] [--repeats 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rstar_jax.rollout.protocol import SamplingParams  # noqa: E402
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler  # noqa: E402
from rstar_jax.rollout.sglang import SGLangGenerator  # noqa: E402
from rstar_jax.serve import LocalServer  # noqa: E402


@dataclasses.dataclass
class Trajectory:
    prompt: list[int]
    turns: list[int]  # tokens generated per turn
    observation: int  # tokens appended after each non-final turn (tool output)


def make_workload(n: int, *, budget: int, prompt_len: int, observation: int, vocab: int, seed: int) -> list[Trajectory]:
    """Long-tailed: 1-4 turns whose lengths are lognormal, total capped by the response budget."""
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(n):
        turns, used = [], 0
        for _ in range(int(rng.integers(1, 5))):
            room = budget - used - observation
            if room < 1:
                break
            length = int(min(room, max(1, rng.lognormal(np.log(40), 1.1))))
            turns.append(length)
            used += length + observation
        work.append(Trajectory(rng.integers(1, vocab, prompt_len).tolist(), turns, observation))
    return work


async def run_policy(scheduler, work: list[Trajectory], *, budget: int, tool_latency: float) -> tuple[float, list[float]]:
    """Runs every trajectory through `scheduler`; returns the makespan and per-trajectory end times."""
    start = time.perf_counter()
    ends = []

    async def one(i: int, t: Trajectory):
        async with scheduler.lease(f"{i:016x}", len(t.prompt) + budget) as gen:
            context = list(t.prompt)
            for turn, length in enumerate(t.turns):
                result = await gen.generate(context, SamplingParams(max_new_tokens=length, temperature=1.0))
                context += result.token_ids
                if turn + 1 < len(t.turns):
                    await asyncio.sleep(tool_latency)  # the tool call
                    context += [1] * t.observation
        ends.append(time.perf_counter() - start)

    await asyncio.gather(*(one(i, t) for i, t in enumerate(work)))
    return time.perf_counter() - start, ends


async def main_async(args, urls: list[str]) -> None:
    gens = [SGLangGenerator(u) for u in urls]
    try:
        work = make_workload(args.trajectories, budget=args.budget, prompt_len=args.prompt_len,
                             observation=args.observation, vocab=320, seed=args.seed)
        tokens = sum(sum(t.turns) for t in work)
        lengths = sorted(sum(t.turns) for t in work)
        print(f"workload: {len(work)} trajectories, {tokens} generated tokens, per-trajectory median "
              f"{lengths[len(lengths) // 2]}, max {lengths[-1]}; servers with {args.slots} slots")
        # Warm-up: compile every prefill bucket on every server so neither policy pays for compiles.
        max_length = (await gens[0].server_info())["context_length"]
        lengths = [n - 2 for n in (64, 128, 256, 512, 1024, 2048, 4096) if n - 2 < max_length - 1]
        await asyncio.gather(*(g.generate([1] * n, SamplingParams(max_new_tokens=2)) for g in gens for n in lengths))
        results: dict[str, list[float]] = {"static": [], "dynamic": []}
        for _ in range(args.repeats):
            for name in ("static", "dynamic"):
                if name == "static":
                    scheduler = RoundRobinScheduler(gens)
                else:
                    scheduler = KvScheduler(gens, budget_fraction=args.budget_fraction)
                makespan, _ = await run_policy(scheduler, work, budget=args.budget, tool_latency=args.tool_latency)
                results[name].append(makespan)
                extra = f", max queue {scheduler.max_queue}" if name == "dynamic" else ""
                print(f"{name:8s} makespan {makespan:7.2f} s  ({tokens / makespan:7.0f} tokens/s{extra})")
        static, dynamic = (float(np.median(results[k])) for k in ("static", "dynamic"))
        print(f"median makespan: static {static:.2f} s, dynamic {dynamic:.2f} s; "
              f"dynamic speed-up {static / dynamic:.2f}x (target >= 1.3x)")
    finally:
        for g in gens:
            await g.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=48)
    parser.add_argument("--slots", default="4,4", help="decode slots per server, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=int, default=768, help="response budget per trajectory (tokens)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--observation", type=int, default=16)
    parser.add_argument("--tool-latency", type=float, default=0.02)
    parser.add_argument("--budget-fraction", type=float, default=0.8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    max_length = 1 << (args.prompt_len + args.budget).bit_length()
    # One CPU thread per server so that servers do not steal each other's cores.
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    servers = [LocalServer(args.model, slots=int(n), max_length=max_length, seed=0, env=env)
               for n in args.slots.split(",")]
    started = []
    try:
        for s in servers:
            started.append(s.__enter__())
        asyncio.run(main_async(args, [s.url for s in started]))
    finally:
        for s in started:
            s.__exit__(None, None, None)


if __name__ == "__main__":
    main()
