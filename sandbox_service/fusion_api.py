"""SandboxFusion's HTTP API on this server (`python -m sandbox_service --http-port P`), for the tools
verl users already run: SandboxFusion's own client (`sandbox_fusion.run_code`) and verl's reward and
tool code, which post to `<base>/run_code`.

    POST /run_code   RunCodeRequest -> RunCodeResponse (only language "python")
    GET  /v1/ping    "pong"

A call is validated, admitted and run exactly as a gRPC Execute (same pool, limits, isolation). The
program runs as `python file.py` would (a script: no display of a trailing expression, Python's own
tracebacks), in a fresh working directory holding the request's `files`; `fetch_files` found there
afterwards come back base64 (a missing one is left out, as SandboxFusion leaves it out). Each output
stream keeps its first 2^20 characters and the program runs on, as SandboxFusion keeps the first MiB;
the text is decoded as UTF-8 with replacement characters. `memory_limit_MB` > 0 bounds the address
space (SandboxFusion's RLIMIT_AS); -1 (its default) leaves the server's default resident limit.

Our statuses -> SandboxFusion's (its sandbox/server/sandbox_api.py `parse_run_status`):

    ok                                  Success       run_result Finished, return_code 0
    runtime_error                       Failed        Finished, the exit code
    memory_limit, killed_by_signal,     Failed        Finished, the exit code (negative: the signal);
      output_limit                                    `message` says which limit
    timeout                             Failed        TimeLimitExceeded, return_code null
    sandbox_error                       SandboxError  run_result Error, its stderr and `message` the reason
    not admitted (queue full)           HTTP 504 with Retry-After: verl retries a 504 only, the
                                        sandbox_fusion client any non-200 answer
    invalid request                     HTTP 422 {"detail": [{"type", "loc": ["body", field, ...], "msg"}]},
                                        FastAPI's shape; a body over the size bound: HTTP 413
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math

from aiohttp import web

from sandbox_service import status
from sandbox_service.server import MAX_STREAM_CAP_CHARS, Pool, ServerOptions, exec_args

log = logging.getLogger("sandbox_service.http")

# RunCodeRequest's defaults (SandboxFusion's sandbox/server/sandbox_api.py).
DEFAULT_RUN_TIMEOUT_S = 10.0
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_MEMORY_LIMIT_MB = -1
# RunCodeRequest.language's other values: valid there, not served here.
FUSION_LANGUAGES = ("python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash",
                    "typescript", "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia",
                    "pytest", "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
# Our field names in the messages of the shared validation (server.exec_args) -> the request's.
_NAMES = {"timeout_s": "run_timeout", "memory_mb": "memory_limit_MB", "code": "code", "stdin": "stdin"}
RETRY_AFTER_S = 1


def max_files_bytes(o: ServerOptions) -> int:
    """`files` land in the call's scratch working directory, which holds no more than this."""
    return o.scratch_mb << 20


def max_body_bytes(o: ServerOptions) -> int:
    """The largest request body worth reading: code and stdin JSON-escaped (at most 6 bytes per
    byte, `\\u00XX`), files base64-encoded (4 bytes per 3), and room for the rest."""
    return 6 * (o.max_code_bytes + o.max_stdin_bytes) + 4 * (max_files_bytes(o) // 3 + 1) + (1 << 20)


class _Invalid(Exception):
    def __init__(self, errors: list[dict]):
        super().__init__("; ".join(e["msg"] for e in errors))
        self.errors = errors


def _error(loc, kind: str, msg: str) -> dict:
    return {"type": kind, "loc": ["body", *loc], "msg": msg}


def path_problem(path) -> str | None:
    """Why `path` cannot name a file in the call's working directory, or None."""
    if not isinstance(path, str) or not path:
        return "a path must be a non-empty string"
    if "\0" in path:
        return f"path {path!r} contains a NUL byte"
    if path.startswith("/"):
        return f"path {path!r} must be relative to the working directory"
    parts = path.split("/")
    if ".." in parts:
        return f"path {path!r} must not have a '..' component"
    if all(p in ("", ".") for p in parts) or path.endswith("/"):
        return f"path {path!r} names a directory, not a file"
    return None


def _number(body: dict, name: str, default: float, errors: list) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        errors.append(_error([name], "float_type", f"{name} must be a finite number of seconds; got {value!r}"))
        return default
    return float(value)


def parse_request(body, o: ServerOptions) -> tuple[list[bytes], float, int, str, dict]:
    """A RunCodeRequest -> `Pool.run("exec", ...)`'s arguments; `_Invalid` lists every problem."""
    if not isinstance(body, dict):
        raise _Invalid([{"type": "model_attributes_type", "loc": ["body"],
                         "msg": f"the body must be a JSON object (RunCodeRequest); got {type(body).__name__}"}])
    errors: list[dict] = []
    code = body.get("code")
    if "code" not in body:
        errors.append(_error(["code"], "missing", "code is required"))
    elif not isinstance(code, str):
        errors.append(_error(["code"], "string_type", f"code must be a string; got {type(code).__name__}"))
    language = body.get("language")
    if "language" not in body:
        errors.append(_error(["language"], "missing", "language is required (this server runs 'python')"))
    elif language != "python":
        known = "a SandboxFusion language this server does not run" if language in FUSION_LANGUAGES else "unknown"
        errors.append(_error(["language"], "literal_error",
                             f"language must be 'python' (the only one this server runs); got {language!r} ({known})"))
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        errors.append(_error(["stdin"], "string_type", f"stdin must be a string or null; got {type(stdin).__name__}"))
    for name in ("code", "stdin"):
        value = body.get(name)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                errors.append(_error([name], "string_unicode", f"{name} is not valid Unicode: lone surrogate at "
                                                               f"position {e.start}"))
    run_timeout = _number(body, "run_timeout", DEFAULT_RUN_TIMEOUT_S, errors)
    if run_timeout <= 0:
        errors.append(_error(["run_timeout"], "greater_than", f"run_timeout must be > 0; got {run_timeout!r}"))
    _number(body, "compile_timeout", DEFAULT_COMPILE_TIMEOUT_S, errors)  # python has no compile step
    memory = body.get("memory_limit_MB", DEFAULT_MEMORY_LIMIT_MB)
    if isinstance(memory, float) and memory.is_integer():
        memory = int(memory)
    if isinstance(memory, bool) or not isinstance(memory, int):
        errors.append(_error(["memory_limit_MB"], "int_type",
                             f"memory_limit_MB must be an integer (-1: the server's default); got {memory!r}"))
        memory = DEFAULT_MEMORY_LIMIT_MB
    files = body.get("files") or {}
    contents: dict[str, bytes] = {}
    if not isinstance(files, dict):
        errors.append(_error(["files"], "dict_type", "files must be an object: path -> base64 content"))
    else:
        for path, content in files.items():
            problem = path_problem(path)
            if problem:
                errors.append(_error(["files", path], "value_error", f"files: {problem}"))
            elif content is None:
                continue  # SandboxFusion writes no file for a null content
            elif not isinstance(content, str):
                errors.append(_error(["files", path], "string_type", f"files[{path!r}] must be base64 text or null"))
            else:
                try:
                    contents[path] = base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError) as e:
                    errors.append(_error(["files", path], "value_error", f"files[{path!r}] is not base64: {e}"))
        total = sum(len(c) for c in contents.values())
        if total > max_files_bytes(o):
            errors.append(_error(["files"], "value_error", f"files hold {total} bytes; the limit is "
                                                           f"{max_files_bytes(o)} (the call's scratch space)"))
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list):
        errors.append(_error(["fetch_files"], "list_type", "fetch_files must be a list of paths"))
        fetch = []
    for i, path in enumerate(fetch):
        problem = path_problem(path)
        if problem:
            errors.append(_error(["fetch_files", i], "value_error", f"fetch_files[{i}]: {problem}"))
    args = body.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        errors.append(_error(["args"], "list_type", "args must be a list of strings (used by pytest only)"))
    if errors:
        raise _Invalid(errors)
    try:
        blobs, timeout, memory_mb, flavour, options = exec_args(
            o, code, stdin or "", timeout_s=run_timeout, memory_mb=max(memory, 0),
            stream_cap_chars=MAX_STREAM_CAP_CHARS, memory_address_space=memory > 0, names=_NAMES)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise _Invalid([_error([field], "value_error", str(e))]) from None
    options.update(script=True, files=list(contents), fetch_files=list(fetch))
    return [*blobs, *contents.values()], timeout, memory_mb, flavour, options


_LIMIT_MESSAGES = {
    status.MEMORY_LIMIT: "memory limit exceeded",
    status.OUTPUT_LIMIT: "output limit exceeded; the program was killed",
    status.KILLED_BY_SIGNAL: "the program was killed by a signal",
}


def response(header: dict, blobs: list[bytes], cap_chars: int) -> dict:
    """A worker's result -> RunCodeResponse (SandboxFusion's field names and nulls)."""
    code = header["status"]
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in blobs[:2])
    found = header.get("files") or []
    files = {path: base64.b64encode(content).decode("ascii") for path, content in zip(found, blobs[2:])}
    worker = header.get("worker") or None
    if code == status.SANDBOX_ERROR:
        message = header.get("message") or "the sandbox failed to run the program"
        return {"status": "SandboxError", "message": message, "compile_result": None,
                "run_result": {"status": "Error", "execution_time": None, "return_code": None, "stdout": None,
                               "stderr": message},
                "executor_pod_name": worker, "files": files}
    timed_out = code == status.TIMEOUT
    run = {"status": "TimeLimitExceeded" if timed_out else "Finished",
           "execution_time": float(header["duration_s"]),
           "return_code": None if timed_out else int(header["exit_code"]), "stdout": stdout, "stderr": stderr}
    notes = [header.get("message", "")] if header.get("message") else []
    if code in _LIMIT_MESSAGES:
        notes.append(f"{code}: {_LIMIT_MESSAGES[code]}")
    for name in ("stdout", "stderr"):
        if header.get(f"{name}_truncated"):
            notes.append(f"{name} cut at {cap_chars} characters")
    ok = code == status.OK
    return {"status": "Success" if ok else "Failed", "message": "; ".join(notes), "compile_result": None,
            "run_result": run, "executor_pod_name": worker, "files": files}


def _detail(status_code: int, detail, headers: dict | None = None) -> web.Response:
    return web.json_response({"detail": detail}, status=status_code, headers=headers)


def make_app(pool: Pool) -> web.Application:
    o = pool.options

    @web.middleware
    async def json_errors(request: web.Request, handler):
        # FastAPI's shape for routing errors too ({"detail": "Not Found"}); no traceback to clients.
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _detail(e.status, e.reason, headers={k: v for k, v in e.headers.items()
                                                         if k.lower() in ("allow", "retry-after")})
        except Exception:  # noqa: BLE001 - logged here; the client gets a 500 without our internals
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _detail(500, "internal server error")

    async def ping(request: web.Request) -> web.Response:
        return web.json_response("pong")

    async def run_code(request: web.Request) -> web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _detail(413, f"the request body exceeds {max_body_bytes(o)} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return _detail(422, [{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {e}"}])
        try:
            blobs, timeout, memory, flavour, options = parse_request(body, o)
        except _Invalid as e:
            return _detail(422, e.errors)
        if not pool.try_admit():
            return _detail(504, pool.full_message(), headers={"Retry-After": str(RETRY_AFTER_S)})
        # try_admit counted this call; Pool.run releases it
        header, out = await pool.run("exec", flavour, blobs, timeout, memory, options, injectable=True)
        pool.counters[header["status"]] = pool.counters.get(header["status"], 0) + 1
        return web.json_response(response(header, out, options["stream_cap_chars"]))

    app = web.Application(client_max_size=max_body_bytes(o), middlewares=[json_errors])
    app.router.add_post("/run_code", run_code)
    app.router.add_get("/v1/ping", ping)
    return app


async def start(pool: Pool, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves `make_app(pool)` on host:port (0: any free port); returns the runner (`cleanup()` stops
    it) and the bound port."""
    runner = web.AppRunner(make_app(pool), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
