"""Load: 5,000 mixed calls at concurrency 256 through gRPC, none lost, every output as expected."""

from __future__ import annotations

import pytest
import asyncio

from sandbox_service import status
from sandbox_service.client import SandboxClient
from sandbox_service.launcher import LocalSandbox

pytestmark = pytest.mark.slow  # a sandbox server subprocess under load

N_CALLS = 5000
CONCURRENCY = 256


def mixed_call(i: int) -> tuple[str, str, str, str, int]:
    """(code, stdin, expected status, expected stdout, expected exit code) of call i."""
    kind = i % 10
    if kind <= 4:
        return f"print({i} * {i})", "", status.OK, f"{i * i}\n", 0
    if kind == 5:
        return "print(int(input()) + 1)", str(i), status.OK, f"{i + 1}\n", 0
    if kind == 6:
        return f"raise ValueError({i})", "", status.RUNTIME_ERROR, "", 1
    if kind == 7:
        return f"x = {i}\nx * 2", "", status.OK, f"{2 * i}\n", 0
    if kind == 8:
        return f"import sys\nprint('bye')\nsys.exit({i % 5 + 1})", "", status.RUNTIME_ERROR, "bye\n", i % 5 + 1
    if i % 100 == 9:  # the sci workers (sympy pre-imported)
        return f"import sympy\nprint(sympy.factorint({i}))", "", status.OK, f"{_factor_dict(i)}\n", 0
    return f"print(sum(range({i})))", "", status.OK, f"{sum(range(i))}\n", 0


def _factor_dict(n: int) -> dict:
    out, d = {}, 2
    while d * d <= n:
        while n % d == 0:
            out[d] = out.get(d, 0) + 1
            n //= d
        d += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def test_5000_mixed_calls_at_concurrency_256():
    calls = [mixed_call(i) for i in range(N_CALLS)]

    async def go(target):
        gate = asyncio.Semaphore(CONCURRENCY)
        async with SandboxClient(target) as client:
            async def one(code, stdin):
                async with gate:
                    return await client.execute(code, stdin)
            results = await asyncio.gather(*(one(c[0], c[1]) for c in calls))
            return results, await client.info()

    with LocalSandbox(workers=1, slots=4, timeout_s=10.0) as sb:
        results, info = asyncio.run(go(sb.target))
    assert len(results) == N_CALLS
    assert sum(r.status == status.SANDBOX_ERROR for r in results) == 0
    bad = []
    for i, (r, (_, _, want_status, want_stdout, want_code)) in enumerate(zip(results, calls)):
        if (r.status, r.stdout, r.exit_code) != (want_status, want_stdout, want_code):
            bad.append((i, r))
        elif i % 10 == 6 and f"ValueError: {i}" not in r.stderr:
            bad.append((i, r))
    assert not bad, bad[:3]
    assert info.counters[status.SANDBOX_ERROR] == 0 and info.counters["worker_restarts"] == 0
    assert info.in_flight == 0
