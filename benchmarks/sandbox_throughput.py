"""Sandbox throughput and latency through gRPC, beside the machine's limit and a naive
`subprocess.run([python, "-c", code])` baseline, all measured in the same run.

    python benchmarks/sandbox_throughput.py [--calls 2000] [--concurrency 1 16 64 256] [--servers 1 2]

Prints calls/s and p50/p99 client-side latency for `print(1+1)` and for a small sympy snippet at each
concurrency, and the isolation level in force. Two references, each measured in this run:
- the lean fork ceiling: one fresh interpreter per core that imports nothing and, per call, forks a
  child that runs the code into a pipe, reads the output and reaps it (no RPC, no isolation; the
  interpreters' start-up is not timed). Trivial rows print their share of it: the fraction of the
  machine's fork-per-call limit the service delivers with full isolation, client included.
- the naive baseline, run with as many threads as CPU cores (its best case).
`--servers 2` adds rows where the client spreads calls over two servers (least loaded).

    python benchmarks/sandbox_throughput.py --peer code-judge=http://127.0.0.1:8088 --peer fusion=http://127.0.0.1:8080

`--peer URL` (repeatable; the kind is probed, or named as code-judge=URL / fusion=URL) compares ours
with peer sandboxes already running instead: code-judge (the rStar2 release's environment) through
`/run` and through `/run/long-batch` batched as the release's client does, and SandboxFusion through
`/run_code`. Every sandbox gets the release's limits (4 s, 384 MB of address space): ours through the
`release` preset's per-call options (rstar_jax.rollout.tool_env), SandboxFusion in each request,
code-judge from its own settings (start it with MAX_EXECUTION_TIME=4 MAX_MEMORY=256); the limits seen
inside each are printed. Workloads: print(1+1), sympy imported per call, a pure-Python loop of about
0.5 s of CPU; for each (workload, concurrency) row ours runs first, then each peer, so that load drifts
touch all of them. calls/s counts correct results only; failures are counted by kind (wrong output,
timeout, error, lost). Then six hostile snippets run once in each sandbox and the report says whether
each was contained. Start the peers as their READMEs say (Redis + code-judge's API and workers;
SandboxFusion's uvicorn app), bound to 127.0.0.1, with numpy and sympy in the interpreter they run
code with; on the development machines /work/peers/start_all.sh does that (see /work/peers/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rstar_jax.rollout.tool_env import ToolEnv  # noqa: E402
from sandbox_service.client import SandboxClient  # noqa: E402
from sandbox_service.launcher import LocalSandbox  # noqa: E402
from sandbox_peers import (LIMITS_PROBE, Hostile, Limits, Listener, Ours, describe_limits,  # noqa: E402 (benchmarks/)
                           detect_kind, parse_peer, peer_drivers, peer_status)

PAYLOADS = {
    "print(1+1)": ("print(1+1)", "2\n"),
    "sympy": ("import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 1))", "(x - 1)*(x + 1)\n"),
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# A lean fork worker: `python -S -I -c LEAN_WORKER code calls`. It waits for a byte on stdin (so
# that start-up is not timed), runs `calls` fork-per-call executions and prints its timings.
LEAN_WORKER = r"""
import os, sys, time
code, calls = compile(sys.argv[1], "<call>", "exec"), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.buffer.read(1)
latencies, start = [], time.perf_counter()
for _ in range(calls):
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        sys.stdout = open(1, "w", closefd=False)
        exec(code, {"__name__": "__main__"})
        sys.stdout.flush()
        os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    latencies.append(time.perf_counter() - t)
print(time.perf_counter() - start, out.decode().strip(), *latencies, flush=True)
"""


def lean_fork_ceiling(code: str, expected: str, calls: int, workers: int) -> dict:
    """The machine's fork-per-call limit: `workers` lean fork workers started, then timed together."""
    procs = [subprocess.Popen([sys.executable, "-S", "-I", "-c", LEAN_WORKER, code, str(calls // workers)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a lean fork worker did not start")
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("g")
            p.stdin.flush()
        lines = [p.stdout.readline().split() for p in procs]
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    lat = [float(x) for line in lines for x in line[2:]]
    if any(line[1] != expected.strip() for line in lines):
        raise RuntimeError(f"lean fork workers produced {[line[1] for line in lines]}")
    return {"calls_s": len(lat) / wall, "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * percentile(lat, 0.99)}


def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of a process."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


class CpuMeter:
    """Where the CPU of a row goes: this process (the client), each server process, their workers'
    zygotes and the call processes those reap (a zygote is PID 1 of its namespace and reaps them)."""

    def __init__(self, server_pids: list[int]):
        self.servers = server_pids
        self.zygotes = [z for s in server_pids for outer in _children(s) for z in _children(outer)]

    def read(self) -> dict:
        t = os.times()
        out = {"client": t.user + t.system, "server": sum(_proc_cpu_s(p)[0] for p in self.servers)}
        zygote = [_proc_cpu_s(p) for p in self.zygotes]
        out["zygotes"], out["call processes"] = sum(z[0] for z in zygote), sum(z[1] for z in zygote)
        return out


def naive(code: str, expected: str, calls: int, threads: int) -> dict:
    def one(_):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if out.stdout != expected:
            raise RuntimeError(f"naive baseline produced {out.stdout!r}")
        return time.perf_counter() - t

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))  # warm-up (page cache)
        t0 = time.perf_counter()
        lat = list(pool.map(one, range(calls)))
        wall = time.perf_counter() - t0
    return {"calls_s": calls / wall, "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * percentile(lat, 0.99)}


FAILURES = ("wrong", "timeout", "error", "lost")


async def measure(execute, code: str, expected: str, calls: int, concurrency: int, *, warmup_code: str | None = None,
                  meter: CpuMeter | None = None) -> dict:
    """`calls` calls of `execute(code)` (-> sandbox_peers.Reply) with `concurrency` in flight, after
    min(calls, 2 * concurrency) warm-up calls of `warmup_code` (default: `code`). calls/s counts correct
    results only; the percentiles are over every call; failures are counted by kind (FAILURES), with
    one example of each."""
    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    failures: Counter = Counter()
    examples: dict[str, str] = {}

    async def one(snippet: str, check: bool) -> None:
        async with gate:
            t = time.perf_counter()
            r = await execute(snippet)
            lat.append(time.perf_counter() - t)
        kind = r.outcome if r.outcome != "ok" else "wrong" if r.stdout != expected else None
        if check and kind:
            failures[kind] += 1
            examples.setdefault(kind, f"{r.detail} stdout={r.stdout[-80:]!r} stderr={r.stderr[-200:]!r}")

    await asyncio.gather(*(one(warmup_code or code, False) for _ in range(min(calls, 2 * concurrency))))
    lat.clear()
    before = meter.read() if meter else {}
    t0 = time.perf_counter()
    await asyncio.gather(*(one(code, True) for _ in range(calls)))
    wall = time.perf_counter() - t0
    after = meter.read() if meter else {}
    cpu_ms = {k: 1e3 * (after[k] - before[k]) / calls for k in before}
    return {"calls_s": (calls - sum(failures.values())) / wall, "p50_ms": 1e3 * statistics.median(lat),
            "p99_ms": 1e3 * percentile(lat, 0.99), "cpu_ms": cpu_ms, "failures": failures, "examples": examples}


async def through_grpc(targets: list[str], code: str, expected: str, calls: int, concurrency: int, batch_size: int,
                       batch_wait_ms: float, meter: CpuMeter | None = None) -> dict:
    async with Ours(targets, batch_size=batch_size, batch_wait_ms=batch_wait_ms, options={}) as ours:
        row = await measure(ours.execute, code, expected, calls, concurrency, meter=meter)
    if row["failures"]:
        raise RuntimeError(f"sandbox failed {dict(row['failures'])} of {calls} calls, e.g. {row['examples']}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("    python benchmarks/sandbox_throughput.py --peer"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls per row for print(1+1); sympy uses a quarter")
    p.add_argument("--naive-calls", type=int, default=60)
    p.add_argument("--concurrency", type=int, nargs="+",
                   help="calls in flight per row (default 1 16 64 256; with --peer 1 16 64)")
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="rows for each number of servers")
    p.add_argument("--payloads", nargs="+", choices=sorted(PAYLOADS), default=list(PAYLOADS))
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="workers per flavour and server")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=1.0)
    p.add_argument("--isolation", choices=("auto", "minimal"), default="auto")
    g = p.add_argument_group("comparison with peer sandboxes (--peer)")
    g.add_argument("--peer", action="append", default=[], metavar="[KIND=]URL",
                   help="a running code-judge or SandboxFusion to compare with (repeatable); KIND: code-judge or "
                        "fusion (default: probed); replaces the rows above with the comparison")
    g.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    g.add_argument("--trivial-calls", type=int, default=400, help="calls per row of print(1+1)")
    g.add_argument("--sympy-calls", type=int, default=200, help="calls per row of sympy imported per call")
    g.add_argument("--loop-calls", type=int, default=60, help="calls per row of the CPU loop")
    g.add_argument("--loop-seconds", type=float, default=0.5, help="CPU seconds of one CPU-loop call (calibrated here)")
    g.add_argument("--no-hostile", action="store_true", help="skip the hostile snippets")
    g.add_argument("--hostile-only", action="store_true", help="only the hostile snippets")
    a = p.parse_args()
    if a.peer:
        a.concurrency = a.concurrency or [1, 16, 64]
        asyncio.run(run_peers(a))
    else:
        a.concurrency = a.concurrency or [1, 16, 64, 256]
        asyncio.run(run(a))


ROW = "{:<12} {:<24} {:>5} {:>6} {:>9.1f} {:>8.2f} {:>8.2f} {:>9} {:>9}"


async def run(a) -> None:
    """One event loop for every gRPC row (grpc.aio channels are bound to their loop)."""
    cores = os.cpu_count() or 1
    print(f"machine: {cores} CPU cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"python {sys.version.split()[0]}")
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(
            LocalSandbox(workers=a.workers, slots=a.slots, isolation=a.isolation, timeout_s=30.0))
            for _ in range(max(a.servers))]
        info = await _info(servers[0].target)
        missing = [k for k, v in info.isolation_features.items() if not v]
        print(f"server: {a.workers} worker(s) x {a.slots} slots per flavour; isolation level {info.isolation_level!r}"
              + (f" (missing: {missing})" if missing else "")
              + (f"; warnings: {info.isolation_warnings}" if info.isolation_warnings else ""))
        print(f"client: batch_size {a.batch_size}, batch_wait_ms {a.batch_wait_ms}, least-loaded over the servers")
        print()
        print(f"{'payload':<12} {'variant':<24} {'conc':>5} {'calls':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'vs naive':>9} {'ceiling':>9}")
        cpu_rows, ceilings = [], []
        for name in a.payloads:
            code, expected = PAYLOADS[name]
            n_naive = a.naive_calls if name == "print(1+1)" else max(8, a.naive_calls // 4)
            base = await asyncio.to_thread(naive, code, expected, n_naive, cores)
            print(ROW.format(name, "naive subprocess.run", cores, n_naive, base["calls_s"], base["p50_ms"],
                             base["p99_ms"], "1.0x", ""), flush=True)
            n = a.calls if name == "print(1+1)" else max(50, a.calls // 4)
            ceiling = None
            if name == "print(1+1)":
                ceiling = await asyncio.to_thread(lean_fork_ceiling, code, expected, 2 * n, cores)
                print(ROW.format(name, "lean fork ceiling", cores, 2 * n, ceiling["calls_s"], ceiling["p50_ms"],
                                 ceiling["p99_ms"], f"{ceiling['calls_s'] / base['calls_s']:.1f}x", "100%"),
                      flush=True)
                ceilings.append(ceiling["calls_s"])
            for count in a.servers:
                targets = [sb.target for sb in servers[:count]]
                variant = "sandbox gRPC" + (f" x{count} servers" if count > 1 else "")
                meter = CpuMeter([sb.proc.pid for sb in servers[:count]])
                for conc in a.concurrency:
                    row = await through_grpc(targets, code, expected, n, conc, a.batch_size, a.batch_wait_ms, meter)
                    share = f"{100 * row['calls_s'] / ceiling['calls_s']:.0f}%" if ceiling else ""
                    print(ROW.format(name, variant, conc, n, row["calls_s"], row["p50_ms"], row["p99_ms"],
                                     f"{row['calls_s'] / base['calls_s']:.1f}x", share), flush=True)
                    cpu_rows.append((name, variant, conc, row["cpu_ms"]))
            if ceiling:  # the machine may have changed under the rows: measure the limit again
                again = await asyncio.to_thread(lean_fork_ceiling, code, expected, 2 * n, cores)
                print(ROW.format(name, "lean fork ceiling, again", cores, 2 * n, again["calls_s"], again["p50_ms"],
                                 again["p99_ms"], f"{again['calls_s'] / base['calls_s']:.1f}x", "100%"), flush=True)
                ceilings.append(again["calls_s"])
    print("\nCPU ms per call (/proc counters over each row; the call processes are reaped by the zygotes)")
    parts = ("client", "server", "zygotes", "call processes")
    print(f"{'payload':<12} {'variant':<24} {'conc':>5} " + " ".join(f"{p:>14}" for p in parts) + f" {'total':>8}")
    for name, variant, conc, cpu in cpu_rows:
        print(f"{name:<12} {variant:<24} {conc:>5} " + " ".join(f"{cpu[p]:>14.2f}" for p in parts)
              + f" {sum(cpu.values()):>8.2f}")
    if ceilings:  # busy cores over calls/s: CPU per call at the ceiling, its fork, run and reap included
        print(f"lean fork ceiling: {1e3 * cores / max(ceilings):.2f} CPU ms per call at its best")
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


WORKLOADS = ("trivial", "sympy", "cpu-loop")
LOOP = "n = 0\nfor i in range({}):\n    n += i\nprint(n)"


def cpu_loop(seconds: float) -> tuple[str, str]:
    """(code, expected stdout) of a pure-Python loop taking about `seconds` of CPU on this machine; run
    at module level, as a sandbox runs it (every sandbox here uses the same CPython build)."""
    iters = 100_000
    for _ in range(3):
        body = compile(LOOP.format(iters).rsplit("\n", 1)[0], "<loop>", "exec")
        t = time.process_time()
        exec(body, {})
        iters = max(1, round(iters * seconds / max(time.process_time() - t, 1e-3)))
    return LOOP.format(iters), f"{iters * (iters - 1) // 2}\n"


PEER_ROW = "{:<9} {:<22} {:>5} {:>6} {:>9.1f} {:>8.1f} {:>8.1f}  {:<26} {:>9}"


def _failures(row: dict) -> str:
    return ", ".join(f"{row['failures'][k]} {k}" for k in FAILURES if row["failures"][k]) or "0"


async def run_peers(a) -> None:
    """Ours (release preset) against running peers: interleaved throughput rows, then the hostile snippets."""
    options = ToolEnv.preset_defaults("release").sandbox_options()
    limits = Limits(options["timeout_s"], options["memory_mb"])
    peers = []
    for spec in a.peer:
        kind, url = parse_peer(spec)
        peers.append((kind or await detect_kind(url), url))
    cores = os.cpu_count() or 1
    print(f"machine: {cores} CPU cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"python {sys.version.split()[0]}")
    print(f"ours, every peer (and code-judge's Redis) and this client all share these {cores} cores")
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(
            LocalSandbox(workers=a.workers, slots=a.slots, isolation=a.isolation, timeout_s=30.0))
        info = await _info(server.target)
        ours = await stack.enter_async_context(
            Ours(server.target, batch_size=a.batch_size, batch_wait_ms=a.batch_wait_ms, options=options))
        # (sandbox, its variants): the hostile snippets run once per sandbox, through its first variant.
        sandboxes = [("ours", [ours])]
        for kind, url in peers:
            variants = [await stack.enter_async_context(d) for d in peer_drivers(kind, url, limits)]
            sandboxes.append(("code-judge" if kind == "code-judge" else "SandboxFusion", variants))
        print(f"ours: gRPC at {server.target}, {a.workers} worker(s) x {a.slots} slots per flavour, isolation "
              f"{info.isolation_level!r}; client batch_size {a.batch_size}, batch_wait_ms {a.batch_wait_ms}; "
              f"release preset per call: {options}")
        for (name, variants), (kind, url) in zip(sandboxes[1:], peers):
            state = await peer_status(kind, url)
            print(f"{name}: {url}" + (f" ({state})" if state else "") + f"; variants: {[v.name for v in variants]}")
        for name, variants in sandboxes:
            print(f"limits inside {name}: {describe_limits(await variants[0].execute(LIMITS_PROBE))}")
        if not a.hostile_only:
            await _peer_rows(a, [v for _, variants in sandboxes for v in variants])
        if not a.no_hostile:
            await _hostile(sandboxes, max(1024, 2 * limits.memory_mb))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


async def _peer_rows(a, drivers: list) -> None:
    trivial, sympy = PAYLOADS["print(1+1)"], PAYLOADS["sympy"]
    workloads = {"trivial": (trivial, a.trivial_calls), "sympy": (sympy, a.sympy_calls)}
    if "cpu-loop" in a.workloads:
        workloads["cpu-loop"] = (cpu_loop(a.loop_seconds), a.loop_calls)
    for d in drivers:  # every sandbox must give the right answers before it is timed
        for code, expected in (trivial, sympy):
            r = await d.execute(code)
            if r.outcome != "ok" or r.stdout != expected:
                print(f"WARNING: {d.name} answered {r.outcome} {r.detail} {r.stdout!r} {r.stderr[-200:]!r}")
    print("\ncalls/s: correct results per second; p50/p99 over every call; warm-up: 2 x conc calls of print(1+1); "
          "ours/peer: calls/s ratio")
    print(f"{'workload':<9} {'sandbox':<22} {'conc':>5} {'calls':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}  "
          f"{'failures':<26} {'ours/peer':>9}")
    ours_rows, code_judge_best = {}, {}  # (workload, conc) -> our row; code-judge's better calls/s
    for name in a.workloads:
        (code, expected), calls = workloads[name]
        for conc in a.concurrency:
            for d in drivers:
                row = await measure(d.execute, code, expected, calls, conc, warmup_code=trivial[0])
                ours = ours_rows.setdefault((name, conc), row)  # drivers[0] is ours
                ratio = "" if row is ours else f"{ours['calls_s'] / row['calls_s']:.2f}x" if row["calls_s"] else "inf"
                print(PEER_ROW.format(name, d.name, conc, calls, row["calls_s"], row["p50_ms"], row["p99_ms"],
                                      _failures(row), ratio), flush=True)
                for kind, example in row["examples"].items():
                    print(f"{'':<9}   e.g. {kind}: {example[:300]}")
                if d.name.startswith("code-judge"):
                    code_judge_best[name, conc] = max(code_judge_best.get((name, conc), 0.0), row["calls_s"])
    for name, need in (("trivial", 2.5), ("sympy", 1.4)):  # the targets this comparison was built to check
        if (name, 16) in code_judge_best:
            ours = ours_rows[name, 16]
            print(f"check: {name} at concurrency 16: ours {ours['calls_s']:.1f} calls/s = "
                  f"{ours['calls_s'] / max(code_judge_best[name, 16], 1e-9):.2f}x code-judge's better variant "
                  f"(target >= {need}x), our failures: {_failures(ours)}")


async def _hostile(sandboxes: list, alloc_mb: int) -> None:
    print(f"\nhostile snippets, each run once under the same limits (allocation: {alloc_mb} MB; the loopback "
          f"target is a listener this benchmark opened on 127.0.0.1)")
    print(f"{'snippet':<22} {'sandbox':<14} {'verdict':<14} evidence")
    rows = {}
    async with Listener() as listener:
        for name, variants in sandboxes:
            probe = Hostile(listener, alloc_mb)
            for snippet, code in probe.snippets():
                probe.before(snippet)
                rows[snippet, name] = probe.judge(snippet, await variants[0].execute(code))
    for snippet in Hostile.NAMES:
        for name, _ in sandboxes:
            contained, evidence = rows[snippet, name]
            verdict = {True: "contained", False: "NOT contained", None: "unclear"}[contained]
            print(f"{snippet:<22} {name:<14} {verdict:<14} {evidence}")


async def _info(target):
    async with SandboxClient(target) as client:
        return await client.info()


if __name__ == "__main__":
    main()
