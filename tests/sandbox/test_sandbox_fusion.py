"""SandboxFusion's HTTP API: our server's endpoint against SandboxFusion's own client (the
`sandbox_fusion` package), and `SandboxFusionExecutor` (the rollout loop on a SandboxFusion
deployment) against our endpoint and against scripted servers. Every listener is on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import time

import pytest
from aiohttp import web

from sandbox_service import fusion_api, status
from sandbox_service.client import SandboxClient
from sandbox_service.fusion_client import CODE_FILE, HARNESS_FILE, META_FILE, SandboxFusionExecutor
from sandbox_service.launcher import LocalSandbox, free_port
from sandbox_service.server import MAX_STREAM_CAP_CHARS, ServerOptions

sandbox_fusion = pytest.importorskip("sandbox_fusion")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    """`app` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# -- the endpoint's request and response mapping (no server) ---------------------------------------

def _parse(body, **options):
    return fusion_api.parse_request(body, ServerOptions(**options))


def _errors(body, **options) -> list[dict]:
    with pytest.raises(fusion_api._Invalid) as info:
        _parse(body, **options)
    return info.value.errors


def test_a_run_code_request_becomes_a_script_call_with_its_files():
    body = {"code": "import numpy\nprint(open('d/in.txt').read())", "language": "python", "stdin": None,
            "run_timeout": 3, "compile_timeout": 7, "memory_limit_MB": 256, "files": {"d/in.txt": b64(b"42"),
                                                                                      "skip.txt": None},
            "fetch_files": ["out.txt"], "args": [], "unknown_field": 1}
    blobs, timeout, memory, flavour, options = _parse(body)
    assert blobs == [body["code"].encode(), b"", b"42"] and (timeout, memory, flavour) == (3.0, 256, "sci")
    assert options == {"script": True, "files": ["d/in.txt"], "fetch_files": ["out.txt"], "error_format": "",
                       "memory_address_space": True, "stream_cap_chars": MAX_STREAM_CAP_CHARS}
    # SandboxFusion's defaults: run_timeout 10 s, memory_limit_MB -1 (here: the server's default memory).
    _, timeout, memory, flavour, options = _parse({"code": "print(1)", "language": "python"})
    assert (timeout, memory, flavour, options["memory_address_space"]) == (10.0, 1024, "lean", False)


@pytest.mark.parametrize("body, loc, message", [
    ({"language": "python"}, ["body", "code"], "code is required"),
    ({"code": 3, "language": "python"}, ["body", "code"], "code must be a string"),
    ({"code": "1"}, ["body", "language"], "language is required"),
    ({"code": "1", "language": "cpp"}, ["body", "language"], "language must be 'python' .* got 'cpp'"),
    ({"code": "1", "language": "python", "stdin": 5}, ["body", "stdin"], "stdin must be a string or null"),
    ({"code": "\ud800", "language": "python"}, ["body", "code"], "not valid Unicode"),
    ({"code": "1", "language": "python", "run_timeout": 0}, ["body", "run_timeout"], "must be > 0"),
    ({"code": "1", "language": "python", "run_timeout": 400}, ["body", "run_timeout"],
     r"run_timeout must be in \(0, 300\]; got 400"),
    ({"code": "1", "language": "python", "run_timeout": "10"}, ["body", "run_timeout"], "finite number"),
    ({"code": "1", "language": "python", "memory_limit_MB": 8}, ["body", "memory_limit_MB"],
     r"memory_limit_MB must be in \[16, 32768\]; got 8"),
    ({"code": "1", "language": "python", "memory_limit_MB": "1G"}, ["body", "memory_limit_MB"], "an integer"),
    ({"code": "1", "language": "python", "files": {"/etc/x": "YQ=="}}, ["body", "files", "/etc/x"], "relative"),
    ({"code": "1", "language": "python", "files": {"a/../../x": "YQ=="}}, ["body", "files", "a/../../x"], r"'\.\.'"),
    ({"code": "1", "language": "python", "files": {"a\0b": "YQ=="}}, ["body", "files", "a\0b"], "NUL"),
    ({"code": "1", "language": "python", "files": {"": "YQ=="}}, ["body", "files", ""], "non-empty"),
    ({"code": "1", "language": "python", "files": {"x": "not base64!"}}, ["body", "files", "x"], "not base64"),
    ({"code": "1", "language": "python", "files": ["x"]}, ["body", "files"], "an object"),
    ({"code": "1", "language": "python", "fetch_files": ["ok", "../up"]}, ["body", "fetch_files", 1], r"'\.\.'"),
    ({"code": "1", "language": "python", "fetch_files": ["dir/"]}, ["body", "fetch_files", 0], "directory"),
    ({"code": "x" * 2000, "language": "python"}, ["body", "code"], "code is 2000 bytes; the limit is 1000"),
    ([1, 2], ["body"], "must be a JSON object"),
])
def test_invalid_requests_name_the_field(body, loc, message):
    errors = _errors(body, max_code_bytes=1000)
    assert [e["loc"] for e in errors] == [loc]
    assert re.search(message, errors[0]["msg"]), errors


def test_every_problem_of_a_request_is_reported_at_once():
    errors = _errors({"code": "1", "language": "go", "run_timeout": -1, "files": {"../a": "YQ=="}})
    assert [e["loc"][1] for e in errors] == ["language", "run_timeout", "files"]


def _header(code: str, exit_code: int = 0, **extra) -> dict:
    return {"status": code, "exit_code": exit_code, "duration_s": 0.25, "cpu_s": 0.1, "stdout_truncated": False,
            "stderr_truncated": False, "message": "", "worker": "lean0", **extra}


@pytest.mark.parametrize("code, exit_code, fusion_status, run_status, return_code, message", [
    (status.OK, 0, "Success", "Finished", 0, ""),
    (status.RUNTIME_ERROR, 3, "Failed", "Finished", 3, ""),
    (status.TIMEOUT, -9, "Failed", "TimeLimitExceeded", None, ""),
    (status.MEMORY_LIMIT, 1, "Failed", "Finished", 1, "memory_limit: memory limit exceeded"),
    (status.OUTPUT_LIMIT, -9, "Failed", "Finished", -9, "output_limit"),
    (status.KILLED_BY_SIGNAL, -11, "Failed", "Finished", -11, "killed_by_signal"),
])
def test_our_statuses_map_to_sandbox_fusions(code, exit_code, fusion_status, run_status, return_code, message):
    r = fusion_api.response(_header(code, exit_code), [b"out \xff\n", b"err"], 1 << 20)
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == (fusion_status, run_status,
                                                                                         return_code)
    assert r["message"].startswith(message) and r["compile_result"] is None and r["files"] == {}
    assert r["run_result"]["stdout"] == "out \ufffd\n" and r["run_result"]["execution_time"] == 0.25
    assert r["executor_pod_name"] == "lean0"


def test_a_sandbox_failure_is_sandbox_fusions_sandbox_error_and_fetched_files_come_back_base64():
    r = fusion_api.response(_header(status.SANDBOX_ERROR, -1, message="worker lost twice"), [b"", b""], 10)
    assert r["status"] == "SandboxError" and r["message"] == "worker lost twice"
    assert r["run_result"] == {"status": "Error", "execution_time": None, "return_code": None, "stdout": None,
                               "stderr": "worker lost twice"}
    r = fusion_api.response(_header(status.OK, files=["a.txt", "b/c"], stdout_truncated=True),
                            [b"x" * 10, b"", b"A", b"\x00\x01"], 10)
    assert r["files"] == {"a.txt": "QQ==", "b/c": "AAE="} and r["message"] == "stdout cut at 10 characters"


class FakePool:
    """What fusion_api needs of server.Pool: admission (refused `refusals` times), a canned run."""

    def __init__(self, refusals: int = 0, **options):
        self.options = ServerOptions(**options)
        self.refusals = refusals
        self.counters: dict = {}
        self.calls, self.injectable = [], []

    def try_admit(self) -> bool:
        self.refusals -= 1
        return self.refusals < 0

    def full_message(self) -> str:
        return "sandbox queue full: 8 calls admitted, limit 8; retry later"

    async def run(self, kind, flavour, blobs, timeout_s, memory_mb, options, *, injectable=False):
        self.calls.append((kind, flavour, blobs, timeout_s, memory_mb, options))
        self.injectable.append(injectable)  # a client's call: --inject-timeout-rate applies to it
        return _header(status.OK), [b"hi\n", b""]


def test_a_full_queue_answers_504_which_sandbox_fusions_client_and_verl_retry():
    """verl's call_sandbox_api retries a 504 only; the sandbox_fusion client any non-200 answer."""
    import requests

    async def go():
        pool = FakePool(refusals=2, max_code_bytes=1000, max_stdin_bytes=1000, scratch_mb=1)
        async with serving(fusion_api.make_app(pool)) as url:
            body = {"code": "print('hi')", "language": "python"}
            first = await asyncio.to_thread(requests.post, f"{url}/run_code", json=body, timeout=30)
            assert first.status_code == 504 and first.headers["Retry-After"] == "1"
            assert "queue full" in first.json()["detail"]
            # The second refusal is retried by the client (tenacity: about a second), then it runs.
            reply = await asyncio.to_thread(sandbox_fusion.run_code, sandbox_fusion.RunCodeRequest(**body),
                                            endpoint=url, max_attempts=3)
            assert reply.status == sandbox_fusion.RunStatus.Success and reply.run_result.stdout == "hi\n"
            assert len(pool.calls) == 1 and pool.counters == {"ok": 1} and pool.injectable == [True]
            # The body bound (from the server's limits), routing errors, all in FastAPI's JSON shape.
            big = await asyncio.to_thread(requests.post, f"{url}/run_code", data=b"x" * (4 << 20), timeout=30)
            assert big.status_code == 413 and "exceeds" in big.json()["detail"]
            missing = await asyncio.to_thread(requests.get, f"{url}/nowhere", timeout=30)
            assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
            wrong = await asyncio.to_thread(requests.get, f"{url}/run_code", timeout=30)
            assert wrong.status_code == 405 and wrong.json() == {"detail": "Method Not Allowed"}

    asyncio.run(go())


# -- the executor against scripted servers -----------------------------------------------------------

def answer(stdout="", stderr="", return_code=0, run_status="Finished", *, status_="Success", files=None,
           message=""):
    return 200, {"status": status_, "message": message, "compile_result": None,
                 "run_result": {"status": run_status, "execution_time": 0.5, "return_code": return_code,
                                "stdout": stdout, "stderr": stderr},
                 "executor_pod_name": None, "files": files or {}}


SANDBOX_ERROR = (200, {"status": "SandboxError", "message": "exception on running code: disk full",
                       "compile_result": None, "run_result": {"status": "Error", "stderr": "disk full"},
                       "executor_pod_name": None, "files": {}})


def scripted(answers=(), *, delay_s: float = 0.0):
    """A SandboxFusion stand-in: each POST /run_code gets the next (HTTP status, body), then success."""
    answers, hits = list(answers), []

    async def run_code(request):
        hits.append(await request.json())
        await asyncio.sleep(delay_s)
        code, body = answers.pop(0) if answers else answer("42\n")
        return web.json_response(body, status=code)

    async def ping(request):
        return web.json_response("pong")

    app = web.Application()
    app.router.add_post("/run_code", run_code)
    app.router.add_get("/v1/ping", ping)
    return app, hits


FAST = {"backoff_s": 0.01, "max_backoff_s": 0.02}


def test_the_request_carries_the_harness_the_code_and_the_options():
    async def go():
        app, hits = scripted()
        async with serving(app) as url, SandboxFusionExecutor(url + "/", **FAST) as executor:
            assert executor.targets == [url] and await executor.ping()
            r = await executor.execute("x = 6 * 7\nx", "in", timeout_s=2.5, memory_mb=384, memory_address_space=True,
                                       error_format="release", cold_imports=True)
            assert (r.status, r.exit_code, r.stdout, r.attempts, r.target) == ("ok", 0, "42\n", 1, url)
        (body,) = hits
        assert {k: body[k] for k in ("language", "stdin", "run_timeout", "memory_limit_MB", "fetch_files")} == {
            "language": "python", "stdin": "in", "run_timeout": 2.5, "memory_limit_MB": 384, "fetch_files": [META_FILE]}
        assert base64.b64decode(body["files"][CODE_FILE]) == b"x = 6 * 7\nx"
        assert b"def run_program(" in base64.b64decode(body["files"][HARNESS_FILE])
        assert "error_format='release'" in body["code"] and "x = 6" not in body["code"]
        compile(body["code"], "driver", "exec")

    asyncio.run(go())


def test_responses_map_to_our_statuses_notes_and_caps():
    async def go():
        app, _ = scripted([
            answer("partial", "", None, "TimeLimitExceeded", status_="Failed"),
            answer("partial", "", None, "TimeLimitExceeded", status_="Failed"),
            answer("", "", -11, status_="Failed"),
            answer("", "Traceback...\nMemoryError\n", 1, status_="Failed", files={META_FILE: b64(b"M")}),
            answer("", "Traceback...\nValueError\n", 1, status_="Failed", files={META_FILE: ""}),
            answer("é" * 40000),
            answer("é" * 40000),
            answer(None, None, 0)])
        async with serving(app) as url, SandboxFusionExecutor(url, **FAST) as ex:
            r = await ex.execute("while True: pass", timeout_s=0.5)
            assert (r.status, r.exit_code, r.stdout) == ("timeout", -9, "partial")
            assert r.stderr == "\n[killed: wall-clock limit of 0.5 s exceeded]\n"  # as the gRPC sandbox notes it
            r = await ex.execute("while True: pass", timeout_s=0.5, error_format="release")
            assert (r.status, r.stderr) == ("timeout", "")  # the release shows the program's output only
            r = await ex.execute("import os; os.kill(os.getpid(), 11)")
            assert (r.status, r.exit_code, r.stderr) == ("killed_by_signal", -11, "\n[killed by signal SIGSEGV]\n")
            assert (await ex.execute("x = bytearray(1 << 40)")).status == "memory_limit"
            assert (await ex.execute("raise ValueError")).status == "runtime_error"
            r = await ex.execute("print('é' * 40000)", stream_cap_chars=5)
            assert (r.status, r.stdout, r.stdout_truncated) == ("ok", "ééééé", True)
            r = await ex.execute("print('é' * 40000)", stream_cap_chars=0)  # 80000 bytes: over the 64 KiB cap
            assert (r.status, r.stdout_truncated) == ("output_limit", True)
            assert r.stdout == "é" * 32768 + "\n[... output truncated: exceeded 65536 bytes]\n"
            r = await ex.execute("pass")
            assert (r.status, r.stdout, r.stderr) == ("ok", "", "")

    asyncio.run(go())


def test_failures_are_retried_refusals_are_not_and_nothing_raises():
    async def go():
        app, hits = scripted([(503, {"detail": "restarting"}), SANDBOX_ERROR, (200, ["not", "a", "response"])])
        async with serving(app) as url, SandboxFusionExecutor(url, **FAST) as ex:
            r = await ex.execute("print(42)")
            assert (r.status, r.stdout, r.attempts) == ("ok", "42\n", 4) and len(hits) == 4
        detail = [{"type": "value_error", "loc": ["body", "run_timeout"], "msg": "run_timeout must be in (0, 300]"}]
        app, hits = scripted([(422, {"detail": detail})])
        async with serving(app) as url, SandboxFusionExecutor(url, **FAST) as ex:
            r = await ex.execute("print(1)", timeout_s=400.0)
            assert (r.status, r.attempts, len(hits)) == ("rejected", 1, 1)
            assert "HTTP 422: body.run_timeout: run_timeout must be in (0, 300]" in r.message
        app, hits = scripted([(500, {"detail": "boom"})] * 3)
        async with serving(app) as url, SandboxFusionExecutor(url, max_retries=2, **FAST) as ex:
            r = await ex.execute("print(1)")
            assert (r.status, r.attempts, len(hits)) == ("sandbox_error", 3, 3)
            assert r.message.startswith("gave up after 3 attempts: ") and "HTTP 500: boom" in r.message

    asyncio.run(go())


def test_calls_go_to_the_least_loaded_url_and_a_dead_one_is_skipped():
    async def go():
        slow_app, slow_hits = scripted(delay_s=0.6)
        fast_app, fast_hits = scripted()
        async with serving(slow_app) as slow, serving(fast_app) as fast, \
                SandboxFusionExecutor([slow, fast], **FAST) as ex:
            # Ties go round robin: six calls at once, three each.
            results = await asyncio.gather(*(ex.execute("print(42)") for _ in range(6)))
            assert {r.target for r in results} == {slow, fast} and len(slow_hits) == len(fast_hits) == 3
            # Two at once (one each): while the slow one runs, every later call goes to the idle URL.
            pair = [asyncio.ensure_future(ex.execute("print(42)")) for _ in range(2)]
            await asyncio.sleep(0.2)
            later = [await ex.execute("print(42)") for _ in range(4)]
            assert all(r.target == fast for r in later) and len(slow_hits) == 4 and len(fast_hits) == 8
            assert all(r.ok for r in await asyncio.gather(*pair))
        app, hits = scripted()
        dead = f"http://127.0.0.1:{free_port()}"
        async with serving(app) as live, SandboxFusionExecutor([dead, live], down_s=60, **FAST) as ex:
            assert not await ex.ping(dead) and await ex.ping(live)
            results = [await ex.execute("print(42)") for _ in range(4)]
            assert all(r.ok and r.target == live for r in results) and len(hits) == 4
            assert [r.attempts for r in results] == [2, 1, 1, 1]  # the dead URL was tried once, then skipped

    asyncio.run(go())


def test_options_sandbox_fusion_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="memory_address_space=False .* cannot be honoured"):
        SandboxFusionExecutor("http://127.0.0.1:1", memory_address_space=False)
    with pytest.raises(ValueError, match="cold_imports=False .* cannot be honoured"):
        SandboxFusionExecutor("http://127.0.0.1:1", cold_imports=False)
    with pytest.raises(ValueError, match="http\\(s\\) base URLs"):
        SandboxFusionExecutor("127.0.0.1:8080")

    async def go():
        async with SandboxFusionExecutor("http://127.0.0.1:1") as ex:
            with pytest.raises(ValueError, match="memory_address_space=False"):
                await ex.execute("print(1)", memory_mb=512)  # a resident limit, as the gRPC sandbox reads it
            with pytest.raises(ValueError, match="cold_imports=False"):
                await ex.execute("print(1)", cold_imports=False, memory_mb=512, memory_address_space=True)
            with pytest.raises(ValueError, match="stream_cap_chars"):
                await ex.execute("print(1)", stream_cap_chars=-1)
            with pytest.raises(ValueError, match="error_format"):
                await ex.execute("print(1)", error_format="short")

    asyncio.run(go())


# -- a real server: SandboxFusion's client, and the executor beside the gRPC client ------------------

@pytest.fixture(scope="module")
def server():
    with LocalSandbox(workers=1, http_port=0, timeout_s=5.0) as sb:
        yield sb


@pytest.mark.slow
def test_sandbox_fusions_client_runs_on_our_endpoint(server):
    import requests

    url = server.http_url
    run = sandbox_fusion.run_code
    Request = sandbox_fusion.RunCodeRequest  # noqa: N806
    assert requests.get(f"{url}/v1/ping", timeout=30).json() == "pong"
    r = run(Request(code="s = input()\nprint(s[::-1])\ns", stdin="abc", language="python"), endpoint=url)
    assert (r.status, r.run_result.status, r.run_result.return_code) == ("Success", "Finished", 0)
    assert r.run_result.stdout == "cba\n" and r.compile_result is None  # a script: no display of `s`
    r = run(Request(code="import sys\nprint(repr(sys.stdin.read()))", language="python"), endpoint=url)
    assert r.run_result.stdout == "''\n"  # no stdin (null), never the text "None"
    r = run(Request(code="print('before')\nraise ValueError('boom')", language="python"), endpoint=url)
    assert (r.status, r.run_result.status, r.run_result.return_code) == ("Failed", "Finished", 1)
    assert r.run_result.stdout == "before\n" and "Traceback" in r.run_result.stderr
    assert r.run_result.stderr.endswith("ValueError: boom\n")
    t0 = time.monotonic()
    r = run(Request(code="print('spin', flush=True)\nwhile True: pass", language="python", run_timeout=0.5),
            endpoint=url)
    assert (r.status, r.run_result.status, r.run_result.return_code) == ("Failed", "TimeLimitExceeded", None)
    assert r.run_result.stdout == "spin\n" and time.monotonic() - t0 < 5
    code = "a, b = map(int, open('data/in.txt').read().split())\nopen('out.txt', 'w').write(str(a * b))"
    r = run(Request(code=code, language="python", files={"data/in.txt": b64(b"6 7")},
                    fetch_files=["out.txt", "never_written.txt"]), endpoint=url)
    assert r.status == "Success" and r.files == {"out.txt": b64(b"42")}  # a missing file is left out
    # A fetched path is read inside the call's scratch only: a symlink out of it is not followed.
    code = "import os\nos.symlink('/etc/passwd', 'p')\nos.mkdir('d')\nos.symlink('/etc', 'e')\nopen('d/f', 'w').write('k')"
    r = run(Request(code=code, language="python", fetch_files=["p", "e/passwd", "d/f", "d"]), endpoint=url)
    assert r.status == "Success" and r.files == {"d/f": b64(b"k")}, r.files
    # memory_limit_MB bounds the address space, as SandboxFusion's RLIMIT_AS does.
    body = {"code": "x = bytearray(300 << 20)", "language": "python", "memory_limit_MB": 128}
    reply = requests.post(f"{url}/run_code", json=body, timeout=30).json()
    assert (reply["status"], reply["run_result"]["return_code"]) == ("Failed", 1)
    assert reply["run_result"]["stderr"].endswith("MemoryError\n") and reply["message"].startswith("memory_limit")
    # Refusals: 422 in FastAPI's shape, naming the field; the client does not retry past max_attempts.
    with pytest.raises(Exception, match="422.*language"):
        run(Request(code="int main() {}", language="cpp"), endpoint=url, max_attempts=1)
    bad = requests.post(f"{url}/run_code", json={"code": 5, "language": "python", "run_timeout": "soon"}, timeout=30)
    assert bad.status_code == 422 and [e["loc"] for e in bad.json()["detail"]] == [["body", "code"],
                                                                                  ["body", "run_timeout"]]
    garbage = requests.post(f"{url}/run_code", data=b"{not json", timeout=30)
    assert garbage.status_code == 422 and garbage.json()["detail"][0]["type"] == "json_invalid"


PROGRAMS = [
    ("print('hello')", ""),
    ("x = 6 * 7\nx", ""),  # a trailing expression's repr is displayed
    ("def f():\n    return 1 / 0\nprint('before')\nf()", ""),
    ("print(1\n", ""),  # SyntaxError
    ("import sys\nprint('bye')\nsys.exit(3)", ""),
    ("n = int(input())\nprint(n * n)\nn", "12"),
    ("import math\nprint('a')\nmath.sqrt(-1)", ""),  # the release's error on a trailing expression
    ("print('x')\nx = 1 / 0", ""),
    ("x = bytearray(400 << 20)", ""),  # MemoryError under the address-space limit
]


def _view(r) -> tuple:
    return r.status, r.exit_code, r.stdout, r.stderr, r.stdout_truncated


async def _both(server, code, stdin="", **options):
    """The same call on the gRPC API and, through the executor, on the HTTP API of one server."""
    async with SandboxClient(server.target) as grpc_client, SandboxFusionExecutor(server.http_url) as executor:
        return await asyncio.gather(grpc_client.execute(code, stdin, **options),
                                    executor.execute(code, stdin, **options))


@pytest.mark.slow
@pytest.mark.parametrize("error_format", ["traceback", "release"])
def test_the_executor_gives_what_the_grpc_sandbox_gives(server, error_format):
    """Through a plain SandboxFusion API (scripts only), the tool semantics are the gRPC sandbox's."""
    options = {"timeout_s": 5.0, "memory_mb": 256, "memory_address_space": True, "cold_imports": True,
               "stream_cap_chars": 1000, "error_format": error_format}

    async def go():
        results = []
        for code, stdin in PROGRAMS:
            ours, theirs = await _both(server, code, stdin, **options)
            assert _view(theirs) == _view(ours), code
            results.append(_view(ours))
        return results

    results = asyncio.run(go())
    assert [r[0] for r in results] == ["ok", "ok", "runtime_error", "runtime_error", "runtime_error", "ok",
                                       "runtime_error", "runtime_error", "memory_limit"]
    assert results[1][2] == "42\n" and results[5][2] == "144\n12\n" and results[4][1] == 3
    if error_format == "release":
        assert results[7][3] == "ZeroDivisionError at line 2: division by zero\n  x = 1 / 0\n"
    else:
        assert results[2][2] == "before\n" and results[2][3].startswith("Traceback (most recent call last):\n")
        assert '  File "<tool>", line 2, in <module>\n    x = 1 / 0\n' in results[7][3]  # trimmed to the user's code
        assert results[7][3].endswith("ZeroDivisionError: division by zero\n")


@pytest.mark.slow
def test_the_executors_timeout_and_stream_caps_match_the_grpc_sandbox(server):
    async def go():
        ours, theirs = await _both(server, "print('tick', flush=True)\nwhile True: pass", timeout_s=0.5,
                                   cold_imports=True)
        assert _view(theirs) == _view(ours) == ("timeout", -9, "tick\n",
                                                "\n[killed: wall-clock limit of 0.5 s exceeded]\n", False)
        ours, theirs = await _both(server, "print('ab' * 5000)", stream_cap_chars=7)
        assert _view(theirs) == _view(ours) == ("ok", 0, "abababa", "", True)
        ours, theirs = await _both(server, "print('y' * 100000)", stream_cap_chars=0)
        # The gRPC sandbox kills the program at the cap; SandboxFusion ran it to its end (exit code 0).
        assert _view(theirs)[2:] == _view(ours)[2:] and theirs.status == ours.status == "output_limit"
        assert theirs.stdout.endswith("y\n[... output truncated: exceeded 65536 bytes]\n")

    asyncio.run(go())


# -- the run's composition root: sandbox.api="sandbox_fusion" with a local server ---------------------

@pytest.mark.slow
def test_a_run_on_sandbox_fusion_executes_its_tool_calls_through_the_http_endpoint():
    """configs/tiny.py with sandbox.api="sandbox_fusion" and launch_local: the run starts our server
    with its HTTP endpoint, waits for /v1/ping and runs a trajectory's tool calls through it in the
    release preset's environment (one-line errors, streams cut at 1000 characters)."""
    from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
    from rstar_jax.config import REPO_CONFIGS, load_config_file, resolve, validate
    from rstar_jax.rollout.loop import run_trajectory
    from rstar_jax.app import builders
    from tests.app.test_builders import health_server
    from tests.rollout.test_rollout_loop import ScriptedGenerator, exact_scorer

    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict({"sandbox.api": "sandbox_fusion", "sandbox.preset": "release",
                                       "sandbox.workers": 1, "rollout.observation_max_chars": 1024})
    config = validate(config)
    loop = dataclasses.replace(resolve.loop_config(config), max_turns=4, response_budget=4096)
    def call(code: str, stdin: str = "") -> str:
        body = {"name": config.rollout.tool_name, "arguments": {"code": code, "input": stdin}}
        return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"

    first, second = call("x = 6 * 7\nx"), call("n = int(input())\ny = n // 0", "5")
    turns = [f"Try. {first}{IM_END}", f"Check. {second}{IM_END}", f"</reason><answer>\\boxed{{42}}</answer>{IM_END}"]
    tok = ByteTokenizer()

    async def go(targets, url):
        async with builders.rollout_resources(config, targets, urls=[url]) as resources:
            assert isinstance(resources.client, SandboxFusionExecutor)
            return await run_trajectory(ScriptedGenerator({"Q": turns}), tok, resources.client, "Q", "42",
                                        config=loop, scorer=exact_scorer)

    with builders.sandbox(config) as targets, health_server() as (url, _):
        assert len(targets) == 1 and targets[0].startswith("http://127.0.0.1:")
        trajectory = asyncio.run(go(targets, url))
    text = tok.decode(trajectory.response_ids)
    assert trajectory.tool_statuses == ["ok", "runtime_error"] and trajectory.reward == 1.0
    assert "<tool_response>\n42\n" in text  # the paper's observation style (configs/tiny.py)
    assert ("reason: runtime_error\nerror message: ZeroDivisionError at line 2: integer division or modulo by zero\n"
            "  y = n // 0\n") in text


@pytest.fixture(scope="module")
def quick_policy(tmp_path_factory):
    """test_evaluate's bigram policy answering at once (no filler), and its questions."""
    from rstar_jax.config import REPO_CONFIGS, load_config_file
    from rstar_jax.model.hf import save_pretrained
    from tests.app.test_evaluate import answering_model, write_questions

    root = tmp_path_factory.mktemp("fusion_eval")
    save_pretrained(answering_model(load_config_file(REPO_CONFIGS / "tiny.py")), root / "hf")
    return {"hf": root / "hf", "questions": write_questions(root / "questions.json")}


@pytest.mark.slow
def test_the_evaluate_command_runs_on_sandbox_fusion(quick_policy, tmp_path):
    """`python -m rstar_jax.evaluate` with sandbox.api=sandbox_fusion and launch_local: the command
    validates the settings, starts our server with its HTTP endpoint, waits for /v1/ping, scores with
    the local verifier and reports; a setting SandboxFusion cannot honour stops it before any work."""
    from tests.app.test_evaluate import _run_cli

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "mode=eval", f"eval.files=('{quick_policy['questions']}',)", "eval.k=1",
                 "metrics.progress_bar=false", f"model.hf_path={quick_policy['hf']}", "sandbox.api=sandbox_fusion",
                 "sandbox.preset=release", "sandbox.verify_via=local", "sandbox.workers=1"]
    result = _run_cli("rstar_jax.evaluate", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "SandboxFusion HTTP API on http://127.0.0.1:" in result.stderr and "sandbox stopped" in result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert "avg@1" in result.stdout and (report["k"], report["overall"]["num_questions"]) == (1, 3)
    refused = _run_cli("rstar_jax.evaluate", [*overrides, "sandbox.preimports=True"], tmp_path)
    assert refused.returncode != 0 and "config.sandbox.preimports: must be False with sandbox.api='sandbox_fusion'" \
        in refused.stderr and "Traceback" not in refused.stderr
