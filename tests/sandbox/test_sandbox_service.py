"""The gRPC API, admission, fault recovery, the client's policies and the degraded isolation level,
against real servers on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from sandbox_service import status
from sandbox_service._pb import pb2, pb2_grpc
from sandbox_service.client import ExecRequest, SandboxClient
from sandbox_service.launcher import LocalSandbox, free_port
from tests.sandbox.test_sandbox_adversarial import processes_in_group, processes_with_uid_in

pytestmark = pytest.mark.slow  # sandbox server subprocesses

UID_BASE = 1_710_000


@pytest.fixture(scope="module")
def sandbox():
    sb = LocalSandbox(workers=1, slots=3, timeout_s=5.0, uid_base=UID_BASE)
    sb.start()
    server_pid = sb.proc.pid
    yield sb
    sb.stop()
    assert processes_in_group(server_pid) == []
    assert processes_with_uid_in(UID_BASE, UID_BASE + 100) == []


@pytest.fixture(scope="module")
def minimal_sandbox():
    with LocalSandbox(workers=1, slots=2, timeout_s=5.0, isolation="minimal") as sb:
        yield sb


def stub_for(sb) -> tuple[grpc.Channel, pb2_grpc.SandboxStub]:
    channel = grpc.insecure_channel(sb.target)
    return channel, pb2_grpc.SandboxStub(channel)


def test_execute_batch_streams_in_completion_order(sandbox):
    channel, stub = stub_for(sandbox)
    with channel:
        reqs = [pb2.ExecuteRequest(request_id=f"r{i}", code=f"import time\ntime.sleep({0.2 * (2 - i)})\nprint({i})")
                for i in range(3)]
        results = list(stub.ExecuteBatch(pb2.ExecuteBatchRequest(requests=reqs), timeout=60))
        assert [r.request_id for r in results] == ["r2", "r1", "r0"]
        assert [r.stdout for r in results] == [b"2\n", b"1\n", b"0\n"]
        assert all(r.status == status.OK and r.exit_code == 0 and r.duration_s > 0 for r in results)
        one = stub.Execute(pb2.ExecuteRequest(code="import sys\nprint('o')\nprint('e', file=sys.stderr)\n1/0"))
        assert (one.status, one.exit_code, one.stdout) == (status.RUNTIME_ERROR, 1, b"o\n")
        assert one.stderr.startswith(b"e\nTraceback") and b"ZeroDivisionError" in one.stderr


def test_health_and_info(sandbox):
    async def go():
        async with SandboxClient(sandbox.target) as client:
            return await client.info()
    info = asyncio.run(go())
    assert info.isolation_level in ("full", "partial", "minimal")
    assert set(info.isolation_features) >= {"pid_namespace", "net_namespace", "seccomp", "per_slot_uid",
                                            "cgroup_memory", "user_namespace"}
    essential = ("pid_namespace", "net_namespace", "mount_namespace", "readonly_host", "seccomp", "per_slot_uid")
    assert (info.isolation_level != "minimal") == all(info.isolation_features[f] for f in essential)
    if info.isolation_features["user_namespace"]:  # each slot's mount namespace is made once, not per call
        assert not [w for w in info.isolation_warnings if "namespace" in w], info.isolation_warnings
    assert (info.workers, info.workers_alive, info.slots_per_worker, info.capacity) == (2, 2, 3, 6)
    assert info.queue_depth == 0 and info.max_queue > 0 and info.default_timeout_s == 5.0
    channel, stub = stub_for(sandbox)
    with channel:
        health = stub.Health(pb2.HealthRequest())
    assert health.serving and health.workers_alive == 2 and health.isolation_level == info.isolation_level


@pytest.mark.parametrize("request_kwargs, field", [
    ({"code": "print(1)", "timeout_s": -1.0}, "timeout_s"),
    ({"code": "print(1)", "timeout_s": 1e9}, "timeout_s"),
    ({"code": "print(1)", "memory_mb": 1}, "memory_mb"),
    ({"code": "x" * (2 << 20)}, "code"),
    ({"code": "print(1)", "stdin": "y" * (2 << 20)}, "stdin"),
    ({"code": "print(1)", "stream_cap_chars": -1}, "stream_cap_chars"),
    ({"code": "print(1)", "error_format": "short"}, "error_format"),
])
def test_invalid_requests_name_the_field(sandbox, request_kwargs, field):
    channel, stub = stub_for(sandbox)
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            stub.Execute(pb2.ExecuteRequest(**request_kwargs))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        request = pb2.ExecuteBatchRequest(requests=[pb2.ExecuteRequest(request_id="a", **request_kwargs)])
        batch = list(stub.ExecuteBatch(request))
        assert len(batch) == 1 and batch[0].status == status.REJECTED and not batch[0].retryable
        assert field in batch[0].message


def test_full_queue_answers_resource_exhausted_at_once_and_the_client_retries():
    with LocalSandbox(workers=1, slots=1, max_queue=0, timeout_s=5.0) as sb:
        channel, stub = stub_for(sb)
        with channel:
            # capacity 2 (one lean + one sci slot) and no queue: two sleepers fill it
            busy = [stub.Execute.future(pb2.ExecuteRequest(code="import time\ntime.sleep(1.5)")) for _ in range(2)]
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as e:
                stub.Execute(pb2.ExecuteRequest(code="print(1)"), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
            assert not any(f.done() for f in busy)  # refused at once, not after a slot freed up
            assert [f.result().status for f in busy] == [status.OK, status.OK]

        async def go():
            async with SandboxClient(sb.target, batch_size=4, backoff_s=0.05) as client:
                return await client.execute_many([f"import time\ntime.sleep(0.2)\nprint({i})" for i in range(8)])

        results = asyncio.run(go())
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
        assert any(r.attempts > 1 for r in results)  # some were refused and sent again


def _worker_pids(server_pid: int, flavour: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"sandbox_service.workers" in args and flavour.encode() in args and \
                    any(a.startswith(f"{server_pid}-".encode()) for a in args):
                pids.append(int(entry))
    return pids


def test_worker_killed_mid_call_is_replaced_and_the_call_retried(sandbox):
    async def go():
        async with SandboxClient(sandbox.target, batch_size=1) as client:
            call = asyncio.create_task(client.execute("import time\ntime.sleep(1.0)\nprint('done')"))
            await asyncio.sleep(0.4)
            victims = _worker_pids(sandbox.proc.pid, "lean")
            assert victims
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # the zygote dies with its outer process (parent-death signal)
                    pass
            result = await call
            after = await client.execute("print('after')")
            return result, after, await client.info()

    result, after, info = asyncio.run(go())
    assert result.status in (status.OK, status.SANDBOX_ERROR), result
    if result.status == status.OK:
        assert result.stdout == "done\n"
    assert after.status == status.OK and after.stdout == "after\n"
    assert info.counters["worker_restarts"] >= 1 and info.workers_alive == 2


def test_server_killed_and_restarted_with_calls_in_flight():
    sb = LocalSandbox(workers=1, slots=4, port=free_port(), timeout_s=5.0)
    sb.start()
    try:
        async def go():
            async with SandboxClient(sb.target, batch_size=4, max_retries=20, max_backoff_s=1.0) as client:
                codes = [f"import time\ntime.sleep(0.5)\nprint({i})" for i in range(16)]
                calls = [asyncio.create_task(client.execute(code)) for code in codes]
                await asyncio.sleep(0.3)
                await asyncio.to_thread(sb.kill)  # SIGKILL of the whole server, calls in flight
                await asyncio.to_thread(sb.start)  # same port
                return await asyncio.gather(*calls)

        results = asyncio.run(go())
    finally:
        sb.stop()
    assert [r.status for r in results] == [status.OK] * 16
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]
    assert any(r.attempts > 1 for r in results)


def test_degraded_isolation_is_announced_and_still_enforces_limits(minimal_sandbox):
    async def go():
        async with SandboxClient(minimal_sandbox.target) as client:
            return (await client.info(), await client.execute("print(1+1)"),
                    await client.execute("while True: pass", timeout_s=1.0))

    info, ok, spin = asyncio.run(go())
    assert info.isolation_level == "minimal" and info.isolation_warnings
    assert not info.isolation_features["seccomp"] and not info.isolation_features["pid_namespace"]
    assert ok.status == status.OK and ok.stdout == "2\n"
    assert spin.status == status.TIMEOUT


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_client_spreads_calls_over_endpoints(sandbox, minimal_sandbox, policy):
    async def go():
        async with SandboxClient([sandbox.target, minimal_sandbox.target], policy=policy, batch_size=1) as client:
            before = [i.counters["ok"] for i in await client.info_all()]
            results = await client.execute_many([ExecRequest(f"print({i})") for i in range(20)])
            after = [i.counters["ok"] for i in await client.info_all()]
            return results, [a - b for a, b in zip(after, before)]

    results, per_server = asyncio.run(go())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]
    assert sum(per_server) == 20 and min(per_server) > 0
    assert {r.target for r in results} == {sandbox.target, minimal_sandbox.target}


def test_execute_batch_yields_in_completion_order_with_indexes(sandbox):
    async def go():
        async with SandboxClient(sandbox.target) as client:
            reqs = [(f"import time\ntime.sleep({0.3 * (2 - i)})\nprint(input())", f"in{i}") for i in range(3)]
            return [r async for r in client.execute_batch(reqs)]

    results = asyncio.run(go())
    assert [r.index for r in results] == [2, 1, 0]
    assert [r.stdout for r in results] == ["in2\n", "in1\n", "in0\n"]


def test_client_rejects_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        SandboxClient("127.0.0.1:1", policy="random")
    with pytest.raises(ValueError, match="targets"):
        SandboxClient([])
    with pytest.raises(ValueError, match="error_format"):
        SandboxClient("127.0.0.1:1", error_format="short")
    with pytest.raises(ValueError, match="stream_cap_chars"):
        SandboxClient("127.0.0.1:1", stream_cap_chars=-5)
    with pytest.raises(ValueError, match="unknown server options"):
        LocalSandbox(workers=1, bogus=1)


def test_injected_timeouts_answer_their_share_without_running_and_never_touch_verify():
    """--inject-timeout-rate (noisy-environment experiments): the chosen calls come back as the
    timeouts a loaded fleet gives, not retried by the client (the policy is meant to see them), the
    others run; the same seed draws the same sequence; verification is never injected."""
    async def go(sb) -> tuple[list, object, object]:
        async with SandboxClient(sb.target) as client:
            results = [await client.execute(f"print({i})", timeout_s=2.0) for i in range(40)]
            verified = [await client.verify("\\boxed{3}", "3") for _ in range(5)]
            return results, verified, await client.info()

    runs = []
    for _ in range(2):
        with LocalSandbox(workers=1, slots=2, timeout_s=5.0, inject_timeout_rate=0.4, inject_seed=7) as sb:
            runs.append(asyncio.run(go(sb)))
    (results, verified, info), (again, _, _) = runs
    injected = [r.status == status.TIMEOUT for r in results]
    assert 5 <= sum(injected) <= 30 and info.counters["injected_timeouts"] == sum(injected)
    assert injected == [r.status == status.TIMEOUT for r in again]  # calls made one at a time: same draws
    for i, r in enumerate(results):
        if r.status == status.TIMEOUT:
            assert r.stdout == "" and "wall-clock limit of 2 s" in r.stderr and "injected" in r.message
            assert r.attempts == 1  # not retried: a timeout is the call's own outcome
        else:
            assert (r.status, r.stdout) == (status.OK, f"{i}\n")
    assert all(v.status == "ok" and v.correct for v in verified)


def test_inject_timeout_rate_out_of_range_is_refused():
    from sandbox_service.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--port", "0", "--inject-timeout-rate", "1.0"])


class _RecordingServicer(pb2_grpc.SandboxServicer):
    """Answers every call at once and records which RPC carried how many calls."""

    def __init__(self):
        self.rpcs: list[tuple[str, int]] = []

    @staticmethod
    def _answer(req):
        return pb2.ExecuteResult(request_id=req.request_id, status=status.OK, stdout=req.code.encode())

    async def Execute(self, request, context):
        self.rpcs.append(("Execute", 1))
        return self._answer(request)

    async def ExecuteBatch(self, request, context):
        self.rpcs.append(("ExecuteBatch", len(request.requests)))
        for req in request.requests:
            yield self._answer(req)


def test_a_lone_call_goes_unary_and_queued_calls_share_one_stream():
    servicer = _RecordingServicer()

    async def go():
        server = grpc.aio.server()
        pb2_grpc.add_SandboxServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with SandboxClient(f"127.0.0.1:{port}", batch_size=8, batch_wait_ms=50) as client:
                lone = await client.execute("a")
                several = await client.execute_many(["b", "c", "d"])
            return lone, several
        finally:
            await server.stop(None)

    lone, several = asyncio.run(go())
    assert (lone.stdout, lone.attempts) == ("a", 1)
    assert [r.stdout for r in several] == ["b", "c", "d"]
    assert servicer.rpcs == [("Execute", 1), ("ExecuteBatch", 3)]
