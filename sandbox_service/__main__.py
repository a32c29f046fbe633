"""`python -m sandbox_service --port PORT [--http-port PORT] [--workers N] ...`: run the sandbox gRPC server
(and SandboxFusion's HTTP API beside it)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from sandbox_service.process import serve
from sandbox_service.server import ServerOptions


def parse_args(argv=None) -> tuple[ServerOptions, argparse.Namespace]:
    d = ServerOptions()
    p = argparse.ArgumentParser(prog="python -m sandbox_service", description="gRPC Python execution sandbox")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port; see --port-file)")
    p.add_argument("--host", default=d.host, help="address to bind (default %(default)s)")
    p.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1),
                   help="worker processes per flavour (lean and sci); default: CPU count")
    p.add_argument("--slots", type=int, default=d.slots, help="concurrent calls per worker (default %(default)s)")
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help="also serve SandboxFusion's HTTP API (POST /run_code, GET /v1/ping) on this port "
                        "(0: any free port; see --http-port-file)")
    p.add_argument("--http-port-file", help="write the bound HTTP port to this file once serving (before --port-file)")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="default wall-clock limit per call")
    p.add_argument("--max-timeout-s", type=float, default=d.max_timeout_s, help="largest limit a request may ask")
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="default memory limit per call")
    p.add_argument("--max-memory-mb", type=int, default=d.max_memory_mb)
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="calls admitted beyond the running capacity; more get RESOURCE_EXHAUSTED")
    p.add_argument("--output-limit-bytes", type=int, default=d.output_limit_bytes, help="cap per output stream")
    p.add_argument("--verify-timeout-s", type=float, default=d.verify_timeout_s)
    p.add_argument("--scratch-mb", type=int, default=d.scratch_mb, help="size of each call's private /tmp and /dev/shm")
    p.add_argument("--pids-max", type=int, default=d.pids_max, help="processes + threads per call")
    p.add_argument("--isolation", choices=("auto", "minimal"), default=d.isolation,
                   help="auto: the strongest the machine allows; minimal: rlimits only (testing)")
    p.add_argument("--uid-base", type=int, default=d.uid_base,
                   help="first of the per-slot uids (default: a range derived from the server's pid)")
    p.add_argument("--preimport", action="append", default=[], metavar="MODULE",
                   help="a module the sci workers pre-import beside numpy, sympy and mpmath, and the start-up "
                        "self-test checks tool code can import (repeat, or separate with commas)")
    p.add_argument("--inject-timeout-rate", type=float, default=d.inject_timeout_rate, metavar="RATE",
                   help="experiments on noisy environments: answer this share of executions as a timeout "
                        "without running them (default %(default)s)")
    p.add_argument("--inject-seed", type=int, default=d.inject_seed, help="seeds --inject-timeout-rate's draws")
    p.add_argument("--parent-pid", type=int, help="stop when this process exits")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    opts = ServerOptions(host=a.host, port=a.port, workers=a.workers, slots=a.slots, timeout_s=a.timeout_s,
                         max_timeout_s=a.max_timeout_s, memory_mb=a.memory_mb, max_memory_mb=a.max_memory_mb,
                         max_queue=a.max_queue, output_limit_bytes=a.output_limit_bytes,
                         verify_timeout_s=a.verify_timeout_s, scratch_mb=a.scratch_mb, pids_max=a.pids_max,
                         isolation=a.isolation, uid_base=a.uid_base, http_port=a.http_port,
                         inject_timeout_rate=a.inject_timeout_rate, inject_seed=a.inject_seed,
                         preimports=tuple(m.strip() for arg in a.preimport for m in arg.split(",") if m.strip()))
    try:
        opts.validate()
    except ValueError as e:
        p.error(str(e))
    if a.http_port_file and a.http_port is None:
        p.error("--http-port-file needs --http-port")
    return opts, a


def main(argv=None) -> None:
    opts, a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s sandbox %(levelname)s %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(opts, port_file=a.port_file, http_port_file=a.http_port_file, parent_pid=a.parent_pid,
                    stop_event=stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
