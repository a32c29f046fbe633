"""Rollout makespan: KV-aware dynamic scheduling vs static round-robin over several engine servers.

Starts N `python -m rstar_jax.serve` servers (random-init preset) on loopback and replays one
long-tailed multi-turn workload over the same warm servers through the SGLang client, once per policy:
- static: `RoundRobinScheduler`, trajectory i goes to server i mod N, all are submitted at once,
  and each server admits from its own queue on SGLang's estimate, overcommitting its KV pool and
  retracting (then recomputing) requests under pressure. Tool calls run as soon as a turn ends.
- static-sync: the same placement, with the per-turn barrier of the baseline the paper measured
  (verl v0.2): on each server, all live trajectories generate a turn, then all tool calls run.
- dynamic: `KvScheduler`, driven as the rollout loop drives it (a session per trajectory, a
  generator per turn): it starts a trajectory on the server with the most free KV budget when its
  expected use fits (`--reservation worst-case`: prompt + whole response budget), keeps its turns
  there, and starts the next as soon as room frees up.
The policies alternate for --repeats rounds on each workload (`--seeds`). The script prints the
median makespans per workload, the dynamic policy's speed-up over each static one (over the summed
medians with several workloads: one draw decides which server gets which long trajectories), and the
retractions each policy caused.

`--slots` and `--pool` are per server. `--slots 16,16 --pool 4096` gives homogeneous servers whose
KV pool (4096 tokens) is far below slots x context. `--slots 16,4 --pool 16384,4096` gives servers
of different size, as on a cluster mixing GPU types or tensor-parallel sizes.

    python benchmarks/rollout_balance.py [--slots 16,16] [--pool 4096] [--trajectories 96]
        [--repeats 3] [--seeds 0,1,2] [--policies static,static-sync,dynamic]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rstar_jax.rollout.protocol import SamplingParams  # noqa: E402
from rstar_jax.rollout.scheduler import (  # noqa: E402
    NEW_TOKEN_RATIO,
    RESERVATIONS,
    KvScheduler,
    RoundRobinScheduler,
)
from rstar_jax.rollout.sglang import SGLangGenerator  # noqa: E402
from rstar_jax.engine.local_server import LocalServer  # noqa: E402


@dataclasses.dataclass
class Trajectory:
    prompt: list[int]
    turns: list[int]  # tokens generated per turn
    observation: int  # tokens appended after each non-final turn (tool output)


def make_workload(n: int, *, budget: int, prompt_len: int, observation: int, vocab: int, seed: int,
                  turn_median: float = 40.0) -> list[Trajectory]:
    """Long-tailed: 1-4 turns whose lengths are lognormal (median `turn_median`, sigma 1.1), total
    capped by the response budget."""
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(n):
        turns, used = [], 0
        for _ in range(int(rng.integers(1, 5))):
            room = budget - used - observation
            if room < 1:
                break
            length = int(min(room, max(1, rng.lognormal(np.log(turn_median), 1.1))))
            turns.append(length)
            used += length + observation
        work.append(Trajectory(rng.integers(1, vocab, prompt_len).tolist(), turns, observation))
    return work


async def _turn(gen, i: int, turn: int, t: Trajectory, context: list[int]) -> int:
    """Generates one turn in place; returns the request's retractions."""
    length = t.turns[turn]
    result = await gen.generate(context, SamplingParams(max_new_tokens=length, temperature=1.0))
    if result.finish_reason != "length" or len(result.token_ids) != length:
        raise RuntimeError(f"trajectory {i} turn {turn}: {result.finish_reason} after "
                           f"{len(result.token_ids)} of {length} tokens")
    context += result.token_ids
    return result.num_retractions


async def run_policy(scheduler, work: list[Trajectory], *, tool_latency: float) -> tuple[float, int]:
    """Runs every trajectory through `scheduler`, each tool call as soon as its turn ends; returns the
    makespan and the retractions it caused."""
    start = time.perf_counter()
    retractions = 0

    async def one(i: int, t: Trajectory):
        nonlocal retractions
        async with scheduler.trajectory(f"{i:016x}", group=i) as session:
            context = list(t.prompt)
            for turn in range(len(t.turns)):
                async with session.turn(len(context), t.turns[turn]) as gen:
                    retractions += await _turn(gen, i, turn, t, context)
                    session.record(t.turns[turn])
                if turn + 1 < len(t.turns):
                    await asyncio.sleep(tool_latency)  # the tool call
                    context += [1] * t.observation

    await asyncio.gather(*(one(i, t) for i, t in enumerate(work)))
    return time.perf_counter() - start, retractions


async def run_turn_synchronous(gens, work: list[Trajectory], *, tool_latency: float) -> tuple[float, int]:
    """The baseline the paper measured against (verl v0.2): trajectory i is assigned to server
    i mod N up front, and each server runs its trajectories turn by turn: every live trajectory
    generates its turn, then all tool calls run, then the next turn starts."""
    start = time.perf_counter()
    retractions = 0

    async def server(gen, items: list[tuple[int, Trajectory]]):
        nonlocal retractions
        contexts = {i: list(t.prompt) for i, t in items}
        for turn in range(max(len(t.turns) for _, t in items)):
            live = [(i, t) for i, t in items if turn < len(t.turns)]
            retractions += sum(await asyncio.gather(*(_turn(gen, i, turn, t, contexts[i]) for i, t in live)))
            calling = [(i, t) for i, t in live if turn + 1 < len(t.turns)]
            if calling:
                await asyncio.sleep(tool_latency)  # the batch's tool calls, in parallel
                for i, t in calling:
                    contexts[i] += [1] * t.observation

    await asyncio.gather(*(server(g, [(i, t) for i, t in enumerate(work) if i % len(gens) == k])
                           for k, g in enumerate(gens)))
    return time.perf_counter() - start, retractions


POLICIES = ("static", "static-sync", "dynamic")


def kv_scheduler(gens, args) -> KvScheduler:
    return KvScheduler(gens, budget_fraction=args.budget_fraction, reservation=args.reservation,
                       new_token_ratio=args.new_token_ratio)


async def run_workload(args, gens, seed: int) -> dict[str, float]:
    """The policies' median makespans on the workload drawn with `seed` (printing each round)."""
    work = make_workload(args.trajectories, budget=args.budget, prompt_len=args.prompt_len,
                         observation=args.observation, vocab=320, seed=seed, turn_median=args.turn_median)
    tokens = sum(sum(t.turns) for t in work)
    lengths = sorted(sum(t.turns) for t in work)
    print(f"workload (seed {seed}): {len(work)} trajectories, {tokens} generated tokens, per-trajectory median "
          f"{lengths[len(lengths) // 2]}, max {lengths[-1]}, response budget {args.budget}")
    # Warm-up: one untimed pass of each policy compiles the prefill (rows x prompt bucket x span) and
    # decode shapes the workload reaches on every server, so no timed run pays for it.
    await run_policy(RoundRobinScheduler(gens), work, tool_latency=args.tool_latency)
    await run_policy(kv_scheduler(gens, args), work, tool_latency=args.tool_latency)
    policies = args.policies.split(",")
    results: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(args.repeats):
        for name in policies:
            extra = ""
            if name == "static-sync":
                makespan, retractions = await run_turn_synchronous(gens, work, tool_latency=args.tool_latency)
            else:
                scheduler = RoundRobinScheduler(gens) if name == "static" else kv_scheduler(gens, args)
                makespan, retractions = await run_policy(scheduler, work, tool_latency=args.tool_latency)
                extra = f", trajectories per server {scheduler.admitted_per_generator()}"
                if name == "dynamic":
                    extra += f", max queue {scheduler.max_queue}, moves {scheduler.moves}"
            results[name].append(makespan)
            print(f"{name:11s} makespan {makespan:7.2f} s  ({tokens / makespan:6.0f} tokens/s, "
                  f"{retractions} retractions{extra})")
    median = {name: float(np.median(results[name])) for name in policies}
    print(f"median makespan (seed {seed}): " + ", ".join(f"{name} {median[name]:.2f} s" for name in policies))
    return median


async def main_async(args, urls: list[str]) -> None:
    gens = [SGLangGenerator(u) for u in urls]
    try:
        infos = await asyncio.gather(*(g.server_info() for g in gens))
        print("servers: " + ", ".join(f"{i['max_running_requests']} slots / {i['max_total_num_tokens']}-token KV pool"
                                      for i in infos) + f", context {infos[0]['context_length']}")
        medians = [await run_workload(args, gens, int(seed)) for seed in args.seeds.split(",")]
        policies = args.policies.split(",")
        if len(medians) > 1:  # one workload draw decides which server gets which long trajectories
            total = {name: sum(m[name] for m in medians) for name in policies}
            print(f"summed over {len(medians)} workloads: " + ", ".join(f"{name} {total[name]:.2f} s"
                                                                       for name in policies))
        else:
            total = medians[0]
        for name in ("static", "static-sync"):
            if name in total and "dynamic" in total:
                print(f"dynamic speed-up over {name}: {total[name] / total['dynamic']:.2f}x")
    finally:
        for g in gens:
            await g.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=96)
    parser.add_argument("--policies", default=",".join(POLICIES), help="in the order each round runs them")
    parser.add_argument("--slots", default="16,16", help="decode slots per server, comma-separated")
    parser.add_argument("--pool", default="4096",
                        help="KV pool tokens per server, comma-separated (one value: every server); "
                             "0: slots x context, never overcommitted")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=768, help="response budget per trajectory (tokens)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--observation", type=int, default=16)
    parser.add_argument("--turn-median", type=float, default=40.0, help="median tokens per turn (lognormal)")
    parser.add_argument("--tool-latency", type=float, default=0.02)
    parser.add_argument("--budget-fraction", type=float, default=1.0, help="KvScheduler's alpha")
    parser.add_argument("--reservation", choices=RESERVATIONS, default="expected")
    parser.add_argument("--new-token-ratio", type=float, default=NEW_TOKEN_RATIO)
    parser.add_argument("--compilation-cache", default=os.path.join(tempfile.gettempdir(), "rollout_balance_xla"),
                        help="the servers' persistent XLA compilation cache ('' for none), so that timed "
                             "rounds do not include compiling a shape the warm-up pass did not reach")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seeds", default="0", help="workload seeds, comma-separated: each is timed, and the "
                                                     "speed-ups are taken over their summed medians")
    args = parser.parse_args()
    max_length = 1 << (args.prompt_len + args.budget).bit_length()
    # One CPU thread per server so that servers do not steal each other's cores.
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    if args.compilation_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=args.compilation_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    slots = [int(n) for n in args.slots.split(",")]
    pools = [int(n) for n in args.pool.split(",")]
    pools = pools * len(slots) if len(pools) == 1 else pools
    if len(pools) != len(slots):
        parser.error(f"--pool has {len(pools)} values for {len(slots)} servers")
    servers = [LocalServer(args.model, slots=n, max_length=max_length, max_total_tokens=pool or None,
                           page_size=args.page_size, seed=0, env=env)
               for n, pool in zip(slots, pools)]
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
