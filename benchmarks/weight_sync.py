"""Weight sync from the trainer to a server: disk fp32 (the baseline) vs disk bf16 vs distributed.

A random-weight policy of `--preset`'s shape (float32 master weights, as the trainer holds them)
goes to a receiver process by the production code paths (`rstar_jax.train.weight_sync`), each timed:

- disk-fp32, the baseline: `DiskSync` exporting float32 (the trainer's dtype) with one writer
  thread, then `/update_weights_from_disk`;
- disk-bf16: `DiskSync` exporting bfloat16 with `--writer-threads` writers;
- distributed: `DistributedSync` (bfloat16; gloo on CPU, NCCL when the policy is on a GPU): the
  group formed once (reported apart), then per bucket one `/update_weights_from_distributed` call
  while the trainer broadcasts; the pushes after it are timed.

The receiver is a stand-in SGLang endpoint in its own process. It answers those routes as
`rstar_jax.serve` does up to the point where the weights are host arrays (disk: every tensor of the
safetensors files read into a fresh NumPy array; distributed: every tensor received and handed to
NumPy) and reports how long that took ("receiver s"). The model swap that follows in a real server
is the same for every path and left out, so a 1.7B model needs one trainer copy in memory, not
two; the receiver drops each tensor once read.

Columns: "convert s", a separate pass of the trainer-side cast and HF layout on device, gathered to
the host, nothing written; "export s", the sync's trainer side (disk: convert and write the files;
distributed: convert); "transfer s", the rest until the server has the weights (disk: the server's
load; distributed: the calls and broadcasts); the total and GB/s of the tensors' bytes over it; then
each total's speed-up over disk-fp32. Each method runs `--repeats` times and the run with the
median total is shown (the development machines are shared). Files go to `--directory` (default
/dev/shm, node-local tmpfs, when present) and are deleted after each run.

    python benchmarks/weight_sync.py --preset qwen3-1.7b               # CPU: gloo on loopback
    python benchmarks/weight_sync.py --preset qwen3-1.7b --methods distributed   # on a GPU: NCCL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

METHODS = ("disk-fp32", "disk-bf16", "distributed")


# -- the receiver (its own process) -------------------------------------------------------------

def receiver(port_file: str) -> None:
    """A stand-in server: /health_generate, /get_server_info and the weight routes, timing how
    long each update takes to put the weights into host arrays (`GET /stats`)."""
    from aiohttp import web

    from rstar_jax.model.hf import SafetensorsReader
    from rstar_jax.engine import weight_transfer

    stats = {"seconds": 0.0, "bytes": 0}
    groups: dict[str, weight_transfer.WeightUpdateGroup] = {}

    async def ok(request):
        return web.json_response({"success": True, "message": "ok"})

    async def info(request):
        return web.json_response({"weight_update_ranks": 1, "max_total_num_tokens": 1})

    async def from_disk(request):
        body = await request.json()
        t0 = time.perf_counter()

        def load():
            reader = SafetensorsReader(sorted(pathlib.Path(body["model_path"]).glob("*.safetensors")))
            for key in reader.keys():
                stats["bytes"] += np.array(reader.get(key)).nbytes  # a fresh host array, then dropped

        await asyncio.to_thread(load)
        stats["seconds"] += time.perf_counter() - t0
        return await ok(request)

    async def init(request):
        body = await request.json()
        groups[body["group_name"]] = await asyncio.to_thread(
            weight_transfer.WeightUpdateGroup.connect, body["master_address"], body["master_port"],
            body["rank_offset"], body["world_size"], group_name=body["group_name"], backend=body["backend"])
        return await ok(request)

    async def distributed(request):
        body = await request.json()
        group = groups[body["group_name"]]
        t0 = time.perf_counter()

        def receive():
            device = "cuda" if group.backend == "nccl" else "cpu"
            for tensor in group.receive(body["dtypes"], body["shapes"], device):
                stats["bytes"] += tensor.numel() * tensor.element_size()
                np.asarray(weight_transfer.to_array(tensor))  # on the host, as the server's load starts

        await asyncio.to_thread(receive)
        stats["seconds"] += time.perf_counter() - t0
        return await ok(request)

    async def destroy(request):
        body = await request.json()
        group = groups.pop(body["group_name"], None)
        if group is None:
            return web.json_response({"success": False, "message": "does not exist"}, status=400)
        group.close()
        return await ok(request)

    async def read_stats(request):
        out = dict(stats)
        stats.update(seconds=0.0, bytes=0)
        return web.json_response(out)

    async def main():
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health_generate", ok)
        app.router.add_get("/get_server_info", info)
        app.router.add_post("/update_weights_from_disk", from_disk)
        app.router.add_post("/init_weights_update_group", init)
        app.router.add_post("/update_weights_from_distributed", distributed)
        app.router.add_post("/destroy_weights_update_group", destroy)
        app.router.add_get("/stats", read_stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        pathlib.Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the trainer side ---------------------------------------------------------------------------

def _gb(n: int) -> float:
    return n / 1e9


def release_heap() -> None:
    """Hands freed heap back to the OS. The random init leaves ~10 GB (1.7B) of freed memory that
    glibc keeps; with it, a float32 export into tmpfs beside the model would run under memory
    pressure on a 23 GB machine and time the pressure, not the export."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def stats(url: str) -> dict:
    """The receiver's time and bytes since the last call."""
    with urllib.request.urlopen(url + "/stats") as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--dtype", default="bfloat16", help="what disk-bf16 and distributed send")
    parser.add_argument("--directory", default="", help="where exports go (default /dev/shm, else a temp dir)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
    parser.add_argument("--writer-threads", type=int, default=4, help="disk-bf16's writers (disk-fp32 uses 1)")
    parser.add_argument("--max-shard-bytes", type=int, default=1 << 30)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 30)
    parser.add_argument("--backend", default="", help="distributed: nccl | gloo ('' = nccl on a GPU, else gloo)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median total is reported")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)  # internal: run the receiver, port into this file
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {METHODS}")

    import jax

    from rstar_jax.model.hf import hf_blocks, host_value
    from rstar_jax.model.qwen3 import Qwen3Config
    from rstar_jax.parallel import create_sharded_model, make_mesh
    from rstar_jax.rollout.sglang import SGLangGenerator
    from rstar_jax.train.weight_sync import DiskSync, DistributedSync

    base = args.directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="weight_sync_bench_", dir=base))
    config = Qwen3Config.preset(args.preset, param_dtype="float32")
    t0 = time.perf_counter()
    model = create_sharded_model(config, make_mesh(fsdp=1, devices=jax.devices()[:1]), seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    params = sum(x.size for x in jax.tree.leaves(model))
    print(f"{args.preset}: {params / 1e9:.2f}B parameters (float32), initialised in {time.perf_counter() - t0:.1f} s; "
          f"{jax.devices()[0].platform}, files under {workdir}", flush=True)
    release_heap()

    def convert(dtype: str) -> tuple[float, int]:
        """The trainer-side cast and HF layout on device, gathered to the host (no write)."""
        t = time.perf_counter()
        nbytes = sum(host_value(block).nbytes for _, block in hf_blocks(model, dtype))
        return time.perf_counter() - t, nbytes

    for dtype in {"float32", args.dtype}:
        convert(dtype)  # compiles the layout transforms once, outside the timings

    port_file = workdir / "port"
    proc = subprocess.Popen([sys.executable, __file__, "--receiver", str(port_file)])
    rows = []
    try:
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the receiver exited with {proc.returncode}")
            time.sleep(0.05)
        time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"

        def median(runs: list[dict]) -> dict:
            """The run with the median total (the machine may be shared), with every run's totals."""
            runs = sorted(runs, key=lambda r: r["total_s"])
            return {**runs[len(runs) // 2], "totals": [round(r["total_s"], 2) for r in runs]}

        async def run() -> None:
            async with SGLangGenerator(url) as gen:
                for method in methods:
                    await gen.weight_update_ranks()  # the receiver answers
                    if method.startswith("disk"):
                        rows.append(median([await disk(gen, method) for _ in range(args.repeats)]))
                    else:
                        rows.append(await distributed(gen))

        async def disk(gen, method: str) -> dict:
            dtype, threads = ("float32", 1) if method == "disk-fp32" else (args.dtype, args.writer_threads)
            convert_s, nbytes = convert(dtype)
            out = workdir / method
            sync = DiskSync([gen], out, dtype=dtype, max_shard_bytes=args.max_shard_bytes, writer_threads=threads)
            t = time.perf_counter()
            await sync.push(model, 1)
            total_s = time.perf_counter() - t
            received = stats(url)
            shutil.rmtree(out)
            release_heap()
            assert received["bytes"] == nbytes, (received, nbytes)
            return dict(method=f"{method} ({threads} writer{'s' if threads > 1 else ''})", bytes=nbytes,
                        convert_s=convert_s, receiver_s=received["seconds"], total_s=total_s, **sync.timings)

        async def distributed(gen) -> dict:
            sync = DistributedSync([gen], dtype=args.dtype, backend=args.backend, bucket_bytes=args.bucket_bytes)
            await sync.push(model, 0)  # the first push also forms the group
            group_s = sync.timings["group_s"]
            stats(url)
            runs = []
            for version in range(1, args.repeats + 1):
                convert_s, nbytes = convert(args.dtype)
                t = time.perf_counter()
                await sync.push(model, version)
                total_s = time.perf_counter() - t
                received = stats(url)
                assert received["bytes"] == nbytes, (received, nbytes)
                runs.append(dict(method=f"distributed ({sync.backend}, buckets of {args.bucket_bytes / 2**20:g} MiB)",
                                 bytes=nbytes, convert_s=convert_s, receiver_s=received["seconds"], total_s=total_s,
                                 export_s=sync.timings["export_s"], transfer_s=sync.timings["transfer_s"],
                                 group_s=group_s))
            await sync.close()
            return median(runs)

        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n{'method':44} {'GB':>6} {'convert s':>9} {'export s':>9} {'transfer s':>10} {'receiver s':>10} "
          f"{'total s':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['method']:44} {_gb(r['bytes']):6.2f} {r['convert_s']:9.2f} {r['export_s']:9.2f} "
              f"{r['transfer_s']:10.2f} {r['receiver_s']:10.2f} {r['total_s']:8.2f} "
              f"{_gb(r['bytes']) / r['total_s']:6.2f}")
        print(f"{'':44} totals of the {len(r['totals'])} runs: {r['totals']} s"
              + (f"; forming the group, once: {r['group_s']:.2f} s" if "group_s" in r else ""))
    baseline = next((r for r in rows if r["method"].startswith("disk-fp32")), None)
    if baseline is not None:
        ratios = ", ".join(f"{r['method'].split(' ')[0]} {baseline['total_s'] / r['total_s']:.2f}x" for r in rows)
        print(f"\nspeed-up of the total vs disk-fp32: {ratios}")
    print(json.dumps({"preset": args.preset, "rows": rows}))


if __name__ == "__main__":
    main()
