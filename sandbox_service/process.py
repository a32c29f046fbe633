"""The sandbox's process: the worker pool, the gRPC service and, when asked, SandboxFusion's HTTP API
over the same pool (`python -m sandbox_service` runs `serve`).

Apart from `server` so that the HTTP API (`fusion_api`, which builds on the server's pool and
options) and the gRPC server are composed here, and neither module imports the other's user.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import grpc

from sandbox_service import selftest
from sandbox_service._pb import pb2_grpc
from sandbox_service.server import Pool, SandboxServicer, ServerOptions

log = logging.getLogger("sandbox_service")

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def serve(options: ServerOptions, *, port_file: str | None = None, http_port_file: str | None = None,
                parent_pid: int | None = None, stop_event: asyncio.Event | None = None) -> None:
    """Starts the workers, then the gRPC server (and SandboxFusion's HTTP API when `options.http_port`
    is set); runs until `stop_event` is set or the parent dies. The bound ports are written to
    `http_port_file`, then `port_file`: once the latter exists, both are serving."""
    options.validate()
    if http_port_file and options.http_port is None:
        raise ValueError("http_port_file needs options.http_port (the HTTP API is off)")
    pool = Pool(options)
    await pool.start()
    summary = pool.isolation_summary()
    if summary["level"] == "full":
        log.info("isolation level: full (%s)", ", ".join(k for k, v in summary["features"].items() if v))
    else:
        missing = ", ".join(k for k, v in summary["features"].items() if not v) or "-"
        log.warning("!!! DEGRADED ISOLATION: level %r; missing: %s; %s !!!", summary["level"], missing,
                    "; ".join(summary["warnings"]))
    checks = await pool.self_test()
    failed = [c for c in checks if not c.ok]
    if failed:  # served all the same: Info carries it, and clients refuse it (ServerInfo.self_test_failures)
        log.error("!!! SELF-TEST FAILED: %s !!!", "; ".join(selftest.failures(failed, sys.executable)))
    else:
        log.info("self-test: tool code imports %s (cold and pre-imported)", selftest.summary(checks))
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(pool), server)
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        await pool.stop()
        raise RuntimeError(f"could not bind {options.host}:{options.port}")
    http_runner = None
    if options.http_port is not None:
        from sandbox_service import fusion_api  # aiohttp only where the HTTP API is on (an optional extra)

        try:
            http_runner, http_port = await fusion_api.start(pool, options.host, options.http_port)
        except OSError as e:
            await pool.stop()
            raise RuntimeError(f"could not bind {options.host}:{options.http_port} for HTTP: {e}") from e
    await server.start()
    log.info("sandbox serving on %s:%d: %d workers x %d slots per flavour (lean, sci), capacity %d, queue %d, "
             "slot uids from %d", options.host, port, options.workers, options.slots, pool.capacity,
             options.max_queue, pool.options.uid_base)
    if http_runner is not None:
        log.info("SandboxFusion HTTP API on http://%s:%d (POST /run_code, GET /v1/ping)", options.host, http_port)
        if http_port_file:
            _write_port(http_port_file, http_port)
    if port_file:
        _write_port(port_file, port)
    stop_event = stop_event or asyncio.Event()
    watcher = asyncio.create_task(_watch_parent(parent_pid, stop_event)) if parent_pid else None
    try:
        await stop_event.wait()
    finally:
        if watcher:
            watcher.cancel()
        if http_runner is not None:
            await http_runner.cleanup()
        await server.stop(grace=0.5)
        await pool.stop()
        log.info("sandbox stopped")


def _write_port(path: str, port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


async def _watch_parent(pid: int, stop_event: asyncio.Event) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; stopping", pid)
            stop_event.set()
            return
        except PermissionError:
            pass
