"""Sandbox throughput and latency through gRPC, beside a naive `subprocess.run([python, "-c", code])`
baseline measured in the same run.

    python benchmarks/sandbox_throughput.py [--calls 2000] [--concurrency 1 16 64 256] [--workers 1]

Prints calls/s and p50/p99 client-side latency for `print(1+1)` and for a small sympy snippet at each
concurrency, the ratio against the naive baseline (run with as many threads as CPU cores, its best
case), and the isolation level in force. Reference (sandbox.md §5): a bare warm fork worker tops out
at about 650 trivial calls/s on 2 cores (430 hardened), with no RPC in the path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox_service.client import SandboxClient  # noqa: E402
from sandbox_service.launcher import LocalSandbox  # noqa: E402

PAYLOADS = {
    "print(1+1)": ("print(1+1)", "2\n"),
    "sympy": ("import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 1))", "(x - 1)*(x + 1)\n"),
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


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


async def through_grpc(target: str, code: str, expected: str, calls: int, concurrency: int, batch_size: int,
                       batch_wait_ms: float) -> dict:
    async with SandboxClient(target, batch_size=batch_size, batch_wait_ms=batch_wait_ms) as client:
        gate = asyncio.Semaphore(concurrency)
        lat: list[float] = []

        async def one():
            async with gate:
                t = time.perf_counter()
                r = await client.execute(code)
                lat.append(time.perf_counter() - t)
                if r.stdout != expected:
                    raise RuntimeError(f"sandbox produced {r.status} {r.stdout!r} {r.stderr[-300:]!r}")

        await asyncio.gather(*(one() for _ in range(min(calls, 2 * concurrency))))  # warm-up
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        wall = time.perf_counter() - t0
    return {"calls_s": calls / wall, "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * percentile(lat, 0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per row for print(1+1); sympy uses a quarter")
    p.add_argument("--naive-calls", type=int, default=60)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="workers per flavour")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=1.0)
    p.add_argument("--isolation", choices=("auto", "minimal"), default="auto")
    a = p.parse_args()
    asyncio.run(run(a))


async def run(a) -> None:
    """One event loop for every gRPC row (grpc.aio channels are bound to their loop)."""
    cores = os.cpu_count() or 1
    print(f"machine: {cores} CPU cores, load average {os.getloadavg()[0]:.1f} at start; "
          f"python {sys.version.split()[0]}")
    async with LocalSandbox(workers=a.workers, slots=a.slots, isolation=a.isolation, timeout_s=30.0) as sb:
        info = await _info(sb.target)
        missing = [k for k, v in info.isolation_features.items() if not v]
        print(f"server: {a.workers} worker(s) x {a.slots} slots per flavour; isolation level {info.isolation_level!r}"
              + (f" (missing: {missing})" if missing else ""))
        print(f"client: batch_size {a.batch_size}, batch_wait_ms {a.batch_wait_ms}")
        print()
        print(f"{'payload':<12} {'variant':<22} {'conc':>5} {'calls':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'vs naive':>9}")
        for name, (code, expected) in PAYLOADS.items():
            n_naive = a.naive_calls if name == "print(1+1)" else max(8, a.naive_calls // 4)
            base = await asyncio.to_thread(naive, code, expected, n_naive, cores)
            print(f"{name:<12} {'naive subprocess.run':<22} {cores:>5} {n_naive:>6} {base['calls_s']:>9.1f} "
                  f"{base['p50_ms']:>8.1f} {base['p99_ms']:>8.1f} {1.0:>8.1f}x", flush=True)
            n = a.calls if name == "print(1+1)" else max(50, a.calls // 4)
            for conc in a.concurrency:
                row = await through_grpc(sb.target, code, expected, n, conc, a.batch_size, a.batch_wait_ms)
                print(f"{name:<12} {'sandbox gRPC':<22} {conc:>5} {n:>6} {row['calls_s']:>9.1f} {row['p50_ms']:>8.1f} "
                      f"{row['p99_ms']:>8.1f} {row['calls_s'] / base['calls_s']:>8.1f}x", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}. Physical reference (sandbox.md §5, bare fork worker, "
          "no RPC, 2 cores): about 650 trivial calls/s (430 hardened).")


async def _info(target):
    async with SandboxClient(target) as client:
        return await client.info()


if __name__ == "__main__":
    main()
