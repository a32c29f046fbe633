"""Weight sync: how the trainer's policy reaches its generators, and the version they report.

The trainer owns one `WeightSync` and pushes after every update (synchronous RL: generators sample
the next step from the weights just trained). The version is the 1-based step of the last update,
so it continues across resumes and every generated token records the policy that produced it.

- `EngineSync`: the in-process `JaxEngine` swaps parameters in place (resharding onto its own
  placements when they differ).
- `DiskSync`: SGLang(-compatible) servers: export Hugging Face safetensors (cast and laid out on the
  trainer's devices, shards written in parallel, into a directory every server can read: node-local
  tmpfs such as /dev/shm when they share the node), then every server loads them with
  `/update_weights_from_disk` and reports the version.
- `DistributedSync`: SGLang's distributed weight update. The trainer is rank 0 of a
  torch.distributed group (NCCL between GPUs, gloo on CPU) that every server joins once
  (`/init_weights_update_group`); each push sends the HF tensors in buckets, each bucket one
  `/update_weights_from_distributed` call per server while rank 0 broadcasts the bucket's tensors
  in the same order. On a GPU the tensors go from JAX to torch through DLPack on the device (a
  parameter sharded over several local GPUs is gathered onto the first, device to device, one
  tensor at a time); nothing passes through the host (except under several trainer processes,
  below). torch is imported when the group is formed (the `distributed-sync` extra).

Modes ("wait" | "abort" | "pause" | "in_place"), for both server syncs: "wait" lets running requests
finish on the old weights first; "abort" sets `abort_all_requests` (running requests return partial
output with finish reason "abort"); "pause" pauses (abort mode), updates and continues; "in_place"
pauses in place (running requests freeze, their KV kept), updates without flushing the prefix
cache (SGLang refuses a flush while requests are frozen, failing the update; `rstar_jax.serve`
drops it anyway) and continues: the frozen requests go on under the new weights, their tokens
labelled per version (`SGLangGenerator`). On SGLang the cached prefixes the old weights computed
stay and new requests may reuse them; the rollout correction sees that as sampler mismatch. A server not yet
seen ready is first waited for (`/health_generate`, up to `ready_timeout_s`): the first sync may
come while it still loads.

Servers out of rotation: a server the rollout's scheduler took out (`rotation`, see
`rstar_jax.rollout.scheduler`) gets no more updates, and one that is unavailable during a push
(refused connection, 5xx, no answer to `/health_generate` after a failed broadcast) is taken out
and the push completes on the others (the distributed group is formed again without it); with no
server left the push fails.

Several trainer processes: every process takes part in the gathers of parameters that span
processes; the writer process (`multihost.is_writer`) alone exports or broadcasts and drives the
servers, and the others wait for it. Such parameters are gathered through the host
(`host_value`), so with NCCL each gathered tensor is copied back to the writer's GPU before its
broadcast.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import pathlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_WRITER_THREADS,
    hf_blocks,
    hf_shapes,
    host_value,
    save_pretrained,
)
from rstar_jax.model.qwen3 import dtype_name
from rstar_jax.parallel import multihost
from rstar_jax.engine import weight_transfer
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.rollout.protocol import GeneratorUnavailable
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator
# Re-exported: defined apart so configs are checked without jax.
from rstar_jax.train.settings import SYNC_METHODS, SYNC_MODES

log = logging.getLogger(__name__)

DISK_SYNC_MODES = SYNC_MODES
DEFAULT_BUCKET_BYTES = 1 << 30


class WeightSync(Protocol):
    """Pushes the policy to the generators; `version` is what they report for it."""

    version: int

    async def push(self, model, version: int) -> None: ...

    def stats(self) -> dict[str, float]:
        """Seconds of the last push's parts, by name (`time/weight_sync_<name>`); {} when it has none."""
        ...


class Rotation(Protocol):
    """The servers in rotation (the rollout's scheduler)."""

    def is_down(self, generator) -> bool: ...

    def mark_down(self, generator, reason: str) -> None: ...


class _ServerSync:
    """What both server syncs share: the servers still updated, and taking one out."""

    generators: list[SGLangGenerator]
    rotation: Rotation | None
    failed: dict[str, str]  # base URL -> why this sync stopped updating it
    timings: dict[str, float]  # the last push's parts, in seconds

    def live(self) -> list[SGLangGenerator]:
        """The servers this push goes to; raises GeneratorUnavailable when none is left."""
        live = [g for g in self.generators if g.base_url not in self.failed
                and not (self.rotation is not None and self.rotation.is_down(g))]
        if not live:
            raise GeneratorUnavailable("weight sync: every server is out of rotation ("
                                       + "; ".join(f"{url}: {why}" for url, why in self.failed.items()) + ")")
        return live

    def stats(self) -> dict[str, float]:
        return dict(self.timings)

    def take_out(self, gen: SGLangGenerator, reason: str) -> None:
        log.warning("weight sync: %s taken out of rotation: %s", gen.base_url, reason)
        self.failed[gen.base_url] = reason
        if self.rotation is not None:
            self.rotation.mark_down(gen, reason)


class EngineSync:
    """The in-process engine samples from `model`'s current parameters after `push`. `in_place`
    (asynchronous RL): the swap happens between two engine steps and running requests go on under the
    new weights, each token keeping its version; otherwise they finish on the old weights first."""

    def __init__(self, engine: JaxEngine, *, in_place: bool = False):
        self.engine = engine
        self.in_place = in_place
        self.version = engine.version

    async def push(self, model, version: int) -> None:
        # Under several processes the engine holds a host-local replica: every process gathers the
        # trained parameters (a collective, so here on the loop's thread, in step with the others).
        source = multihost.host_state(model) if jax.process_count() > 1 else model
        # update_weights blocks until running requests drain; keep the event loop free meanwhile.
        self.version = await asyncio.to_thread(self.engine.update_weights, source, version=version,
                                               in_place=self.in_place)

    def stats(self) -> dict[str, float]:
        return {}  # one swap in place: time/weight_sync_s is all of it


# The sync modes that pause the servers around an update, and the pause mode each uses.
PAUSING_MODES = {"pause": "abort", "in_place": "in_place"}


def _check_mode(mode: str, who: str) -> None:
    if mode not in SYNC_MODES:
        raise ValueError(f"{who}: mode must be one of {SYNC_MODES}, got {mode!r}")


async def _on_every_server(generators: Sequence[SGLangGenerator], mode: str, ready_timeout_s: float,
                           update: Callable[[SGLangGenerator, bool], Awaitable],
                           take_out: Callable[[SGLangGenerator, str], None] | None = None) -> None:
    """`update(gen, abort_all_requests)` on every server at once, in `mode`, each server waited
    for first if it has not been seen ready (an update is sent once: never to a server still loading).
    With `take_out`, a server that is unavailable is passed to it instead of failing the push,
    unless every server is."""
    async def one(gen: SGLangGenerator):
        if not gen.ready:
            await gen.wait_ready(ready_timeout_s)
        if mode in PAUSING_MODES:
            await gen.pause(PAUSING_MODES[mode])
            try:
                await update(gen, False)
            finally:
                await gen.resume()
        else:
            await update(gen, mode == "abort")

    results = await asyncio.gather(*(one(g) for g in generators), return_exceptions=True)
    others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, GeneratorUnavailable)]
    if others:
        raise others[0]
    lost = [(g, r) for g, r in zip(generators, results) if isinstance(r, GeneratorUnavailable)]
    if lost and (take_out is None or len(lost) == len(generators)):
        raise lost[0][1]
    for gen, error in lost:
        take_out(gen, f"weight update failed: {error}")


class DiskSync(_ServerSync):
    """HF export to `directory`, then `/update_weights_from_disk` on every server in rotation (see
    the module docstring for the modes and `rotation`). `dtype`: the exported tensors' (default the
    model's parameter dtype); `max_shard_bytes` and `writer_threads`: `save_pretrained`'s. After a
    push, `timings` holds the seconds of its trainer-side export (`export_s`) and of the servers'
    load (`transfer_s`)."""

    def __init__(self, generators: Sequence[SGLangGenerator], directory: str | os.PathLike, *, mode: str = "wait",
                 dtype=None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 writer_threads: int = DEFAULT_WRITER_THREADS, ready_timeout_s: float = 900.0,
                 rotation: Rotation | None = None):
        _check_mode(mode, "DiskSync")
        self.generators = list(generators)
        self.rotation, self.failed = rotation, {}
        self.directory = pathlib.Path(directory)
        self.mode = mode
        self.dtype = dtype
        self.max_shard_bytes, self.writer_threads = max_shard_bytes, writer_threads
        self.ready_timeout_s = ready_timeout_s
        self.version = 0
        self.timings: dict[str, float] = {}

    async def push(self, model, version: int) -> None:
        await sync_weights_via_disk(model, self.live(), self.directory, version=version, mode=self.mode,
                                    dtype=self.dtype, ready_timeout_s=self.ready_timeout_s,
                                    max_shard_bytes=self.max_shard_bytes, writer_threads=self.writer_threads,
                                    timings=self.timings, take_out=self.take_out)
        self.version = version


async def sync_weights_via_disk(model, generators: Sequence[SGLangGenerator], directory: str | os.PathLike, *,
                                version: int, mode: str = "abort", dtype=None, ready_timeout_s: float = 900.0,
                                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                                writer_threads: int = DEFAULT_WRITER_THREADS, timings: dict | None = None,
                                take_out: Callable[[SGLangGenerator, str], None] | None = None) -> str:
    """Exports `model` as HF safetensors into `directory` and loads it on every server (see
    `DiskSync` for the modes), after waiting for any server not yet seen ready. Every server reports
    `version` afterwards. Returns the directory; `timings`, when given, receives `export_s` and
    `transfer_s` (the servers' load). `take_out(gen, reason)`: where an unavailable server goes
    instead of failing the sync (unless every server is unavailable)."""
    _check_mode(mode, "sync_weights_via_disk")
    export = dict(dtype=dtype, max_shard_bytes=max_shard_bytes, writer_threads=writer_threads)
    timings = {} if timings is None else timings
    start = time.perf_counter()
    # Every process takes part in the export's gathers (one writes). Under several processes the
    # writer process loads every server once the files are complete, and the others wait for it.
    if jax.process_count() > 1:
        path = save_pretrained(model, directory, **export)  # collectives stay on this thread
        multihost.barrier(f"weights {version} exported")
        if not multihost.is_writer():
            multihost.barrier(f"weights {version} loaded")
            return os.fspath(path)
    else:
        path = await asyncio.to_thread(save_pretrained, model, directory, **export)
    timings["export_s"] = time.perf_counter() - start

    async def load(gen: SGLangGenerator, abort: bool):
        await gen.update_weights_from_disk(path, abort_all_requests=abort, weight_version=version,
                                           flush_cache=mode != "in_place")

    start = time.perf_counter()
    await _on_every_server(generators, mode, ready_timeout_s, load, take_out)
    timings["transfer_s"] = time.perf_counter() - start
    multihost.barrier(f"weights {version} loaded")
    return os.fspath(path)


class DistributedSync(_ServerSync):
    """SGLang's distributed weight update from this trainer (rank 0) to every server in rotation.

    The first push makes the group: each server's rank count (`weight_update_ranks`: one per GPU
    on SGLang, one for `rstar_jax.serve`) gives `world_size = 1 + sum` and the servers' rank offsets;
    the trainer binds the TCP store on `master_address:master_port` ("" = the address the servers
    reach this host by; 0 = a free port), a group of the same name left on a server by an earlier
    trainer is destroyed, and every server's `/init_weights_update_group` runs while the trainer
    joins (a rendezvous). Each push then sends the HF tensors in `dtype` (default the model's) in
    buckets of at most `bucket_bytes` (one larger tensor goes alone): for each bucket every server
    gets `/update_weights_from_distributed` while the trainer broadcasts the bucket's tensors in
    order; on servers that keep weight-update sessions (SGLang 0.5.23) the buckets go inside one
    (`/begin_weight_update` ... `/end_weight_update`). `weight_version` goes with the last bucket. `backend`: "nccl" or "gloo" ("" = nccl when
    the policy lives on GPUs, else gloo). `timeout_s` bounds the rendezvous and each broadcast.
    `close()` destroys the group on the servers. After a push, `timings` holds the seconds spent
    making the tensors (`export_s`: on-device cast and layout, gathers), sending them (`transfer_s`:
    the servers' calls and the broadcasts, until every server has loaded them) and forming the
    group (`group_s`, the first push only). The group holds the servers in rotation (`rotation`):
    when one leaves, the next push forms the group again without it; a push that fails takes out
    the servers that no longer answer `/health_generate` and is retried once on the others.
    """

    def __init__(self, generators: Sequence[SGLangGenerator], *, master_address: str = "", master_port: int = 0,
                 backend: str = "", group_name: str = weight_transfer.DEFAULT_GROUP_NAME,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype=None, mode: str = "wait",
                 ready_timeout_s: float = 900.0, timeout_s: float = 600.0, rotation: Rotation | None = None):
        _check_mode(mode, "DistributedSync")
        if backend not in ("", *weight_transfer.BACKENDS):
            raise ValueError(f"DistributedSync: backend must be '' or one of {weight_transfer.BACKENDS}, "
                             f"got {backend!r}")
        if bucket_bytes < 1:
            raise ValueError(f"DistributedSync: bucket_bytes must be >= 1, got {bucket_bytes}")
        if not generators:
            raise ValueError("DistributedSync: no servers")
        self.generators = list(generators)
        self.rotation, self.failed = rotation, {}
        self._members: list[SGLangGenerator] = []  # the servers in the group
        self.master_address, self.master_port = master_address, master_port
        self.backend = backend or ("nccl" if jax.default_backend() == "gpu" else "gloo")
        self.group_name, self.bucket_bytes, self.dtype, self.mode = group_name, bucket_bytes, dtype, mode
        self.ready_timeout_s, self.timeout_s = ready_timeout_s, timeout_s
        self.version = 0
        self.timings: dict[str, float] = {}
        self._group: weight_transfer.WeightUpdateGroup | None = None
        self._device = jax.local_devices()[0]  # where rank 0's tensors are broadcast from

    async def push(self, model, version: int) -> None:
        try:
            await self._push(model, version)
        except SGLangError as e:
            if not (multihost.is_writer() and await self._take_out_silent(e)):
                raise
            log.warning("weight sync: retrying version %d on the %d server(s) left", version, len(self.live()))
            await self._push(model, version)

    async def _take_out_silent(self, error: BaseException) -> bool:
        """After a failed push: takes out the servers that no longer complete a generation; True if any."""
        members = [g for g in self._members if g.base_url not in self.failed]
        healthy = await asyncio.gather(*(g.health() for g in members))
        silent = [g for g, ok in zip(members, healthy) if not ok]
        for gen in silent:
            self.take_out(gen, f"no answer to /health_generate after a failed weight update: {error}")
        return bool(silent) and len(silent) < len(members)

    async def _push(self, model, version: int) -> None:
        writer = multihost.is_writer()
        timings = dict(export_s=0.0, transfer_s=0.0, group_s=0.0)
        if writer:
            live = self.live()
            for gen in live:  # one at a time: a server still loading is waited for
                if not gen.ready:
                    await gen.wait_ready(self.ready_timeout_s)
            if self._group is not None and live != self._members:  # a server left: form the group anew
                await self.close()
            if self._group is None:
                start = time.perf_counter()
                await self._init_group(live)
                timings["group_s"] = time.perf_counter() - start
            if self.mode in PAUSING_MODES:
                await asyncio.gather(*(g.pause(PAUSING_MODES[self.mode]) for g in self._members))
        try:
            if writer:  # SGLang 0.5.23 loads distributed updates only inside a session
                await asyncio.gather(*(g.begin_weight_update() for g in self._members))
            tensors = self._tensors(model)
            plan = self._plan(model)
            for index, names in enumerate(plan):
                # Under several processes the gathers are collectives: they stay on this thread.
                take = lambda n=len(names): list(itertools.islice(tensors, n))  # noqa: E731
                start = time.perf_counter()
                bucket = take() if jax.process_count() > 1 else await asyncio.to_thread(take)
                timings["export_s"] += time.perf_counter() - start
                if writer:
                    start = time.perf_counter()
                    await self._send(names, bucket, version if index == len(plan) - 1 else None)
                    timings["transfer_s"] += time.perf_counter() - start
        except BaseException:
            group, self._group = self._group, None  # out of step with the servers now: a later push forms a new one
            if group is not None:
                group.close()
            raise
        finally:
            if writer:
                ended = await asyncio.gather(*(g.end_weight_update() for g in self._members), return_exceptions=True)
                for gen, outcome in zip(self._members, ended):
                    if isinstance(outcome, BaseException):
                        log.warning("%s: closing the weight-update session failed: %s", gen.base_url, outcome)
            if writer and self.mode in PAUSING_MODES:
                await asyncio.gather(*(g.resume() for g in self._members), return_exceptions=True)
        multihost.barrier(f"weights {version} broadcast")
        self.version, self.timings = version, timings

    async def close(self) -> None:
        """Destroys the group on every server and here (no-op before the first push)."""
        group, self._group = self._group, None
        if group is None:
            return
        await asyncio.gather(*(self._destroy(g) for g in self._members))
        group.close()

    # -- the group ----------------------------------------------------------------------------
    async def _init_group(self, members: list[SGLangGenerator]) -> None:
        ranks = await asyncio.gather(*(g.weight_update_ranks() for g in members))
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        address = self.master_address or reachable_address([g.base_url for g in members])
        group = await asyncio.to_thread(weight_transfer.WeightUpdateGroup.host, address, self.master_port, world_size,
                                        group_name=self.group_name, backend=self.backend, timeout_s=self.timeout_s)
        await asyncio.gather(*(self._destroy(g) for g in members))  # one an earlier trainer left
        joins = [g.init_weights_update_group(address, group.port, offset, world_size, group_name=self.group_name,
                                             backend=self.backend)
                 for g, offset in zip(members, offsets)]
        await _together(group.join, joins, f"joining weight-update group {self.group_name!r} at {address}:{group.port} "
                                           f"({self.backend}, {world_size} ranks)")
        self._group, self._members = group, list(members)
        log.info("weight-update group %r: %d ranks over %d server(s) at %s:%d (%s)", self.group_name, world_size,
                 len(members), address, group.port, self.backend)

    async def _destroy(self, gen: SGLangGenerator) -> None:
        try:
            await gen.destroy_weights_update_group(self.group_name)
        except SGLangError:
            pass  # nothing to destroy, or a server that is gone

    # -- the tensors --------------------------------------------------------------------------
    def _plan(self, model) -> list[list[str]]:
        """HF names per bucket, in `hf_tensors` order: sizes are known from the shapes alone."""
        itemsize = np.dtype(jnp.dtype(dtype_name(self.dtype or model.config.param_dtype))).itemsize
        buckets: list[list[str]] = [[]]
        size = 0
        for name, shape in hf_shapes(model):
            nbytes = int(np.prod(shape)) * itemsize
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        return buckets

    def _tensors(self, model) -> Iterator:
        """torch tensors in `hf_tensors` order (None on processes other than the writer), handed
        over from JAX without a copy where the array is on one device: DLPack, views per layer."""
        writer = multihost.is_writer()
        for m, block in hf_blocks(model, self.dtype):
            count = model.config.num_layers if m.stacked else 1
            if not block.is_fully_addressable:  # spans processes: gathered through the host
                host = host_value(block)
                if not writer:
                    yield from itertools.repeat(None, count)
                    continue
                whole = self._on_device(weight_transfer.to_tensor(host))
                yield from (whole if m.stacked else [whole])
            elif len(block.sharding.device_set) == 1:
                whole = weight_transfer.to_tensor(block)
                yield from (whole if m.stacked else [whole])  # a layer of a contiguous block is contiguous
            else:  # sharded over this process's devices: each tensor gathered onto one device
                for i in range(count):
                    part = block[i] if m.stacked else block
                    yield weight_transfer.to_tensor(jax.device_put(part, self._device))

    def _on_device(self, tensor):
        return tensor.cuda() if self.backend == "nccl" and tensor.device.type == "cpu" else tensor

    async def _send(self, names: list[str], tensors: list, version: int | None) -> None:
        dtypes = [weight_transfer.dtype_name(t) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        abort = self.mode == "abort"
        calls = [g.update_weights_from_distributed(names, dtypes, shapes, group_name=self.group_name,
                                                   weight_version=version, abort_all_requests=abort,
                                                   flush_cache=self.mode != "in_place")
                 for g in self._members]
        await _together(lambda: self._group.broadcast(tensors), calls,
                        f"broadcasting {len(names)} tensors ({names[0]} ...) to {len(self._members)} server(s)")


async def _together(blocking: Callable[[], None], calls: Sequence[Awaitable], what: str) -> None:
    """Runs `blocking` (a collective) on a daemon thread while `calls` (the servers' side of it) are
    in flight; raises as soon as either fails. A server that fails leaves the collective waiting
    for its timeout; the daemon thread does not hold the process open meanwhile."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(None)

    def run():
        error = None
        try:
            blocking()
        except BaseException as e:  # noqa: BLE001  (handed to the event loop)
            error = e
        loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="weight-update-collective", daemon=True).start()
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        pending = {done, *tasks}
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in finished:
                if task.exception() is not None:
                    raise task.exception()
    except Exception as e:
        for task in tasks:
            task.cancel()
        raise SGLangError(f"{what}: {e}") from e


def reachable_address(urls: Sequence[str]) -> str:
    """This host's address as the servers at `urls` reach it: loopback when they all are on this
    host, else the local address of the route to the first remote one (no packet is sent)."""
    hosts = [urllib.parse.urlsplit(url).hostname or "" for url in urls]
    remote = [h for h in hosts if not _is_loopback(h)]
    if not remote:
        return "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(remote[0], 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["SYNC_METHODS", "SYNC_MODES", "DISK_SYNC_MODES", "DEFAULT_BUCKET_BYTES", "WeightSync", "EngineSync",
           "DiskSync", "DistributedSync", "sync_weights_via_disk", "reachable_address"]
