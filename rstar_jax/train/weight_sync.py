"""Weight sync: how the trainer's policy reaches its generators, and the version they report.

The trainer owns one `WeightSync` and pushes after every update (synchronous RL: generators sample
the next step from the weights just trained). The version is the 1-based step of the last update,
so it continues across resumes and every generated token records the policy that produced it.

- `EngineSync`: the in-process `JaxEngine` swaps parameters in place (resharding onto its own
  placements when they differ).
- `DiskSync`: SGLang(-compatible) servers: export Hugging Face safetensors, then every server loads
  them with `/update_weights_from_disk` and reports the version.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
from typing import Protocol, Sequence

import jax

from rstar_jax.model.hf import save_pretrained
from rstar_jax.parallel import multihost
from rstar_jax.rollout.engine import JaxEngine
from rstar_jax.rollout.sglang import SGLangGenerator

DISK_SYNC_MODES = ("abort", "pause", "wait")


class WeightSync(Protocol):
    """Pushes the policy to the generators; `version` is what they report for it."""

    version: int

    async def push(self, model, version: int) -> None: ...


class EngineSync:
    """The in-process engine samples from `model`'s current parameters after `push`."""

    def __init__(self, engine: JaxEngine):
        self.engine = engine
        self.version = engine.version

    async def push(self, model, version: int) -> None:
        # Under several processes the engine holds a host-local replica: every process gathers the
        # trained parameters (a collective, so here on the loop's thread, in step with the others).
        source = multihost.host_state(model) if jax.process_count() > 1 else model
        # update_weights blocks until running requests drain; keep the event loop free meanwhile.
        self.version = await asyncio.to_thread(self.engine.update_weights, source, version=version)


class DiskSync:
    """HF export to `directory`, then `/update_weights_from_disk` on every server.

    mode "wait": servers let running requests finish on the old weights first; "abort":
    `abort_all_requests` (running requests return partial output with finish reason "abort");
    "pause": pause (abort mode), update, continue. A server not yet seen ready is first waited for
    (`/health_generate`, up to `ready_timeout_s`): the first sync may come while it still loads.
    """

    def __init__(self, generators: Sequence[SGLangGenerator], directory: str | os.PathLike, *, mode: str = "wait",
                 dtype=None, ready_timeout_s: float = 900.0):
        if mode not in DISK_SYNC_MODES:
            raise ValueError(f"DiskSync: mode must be one of {DISK_SYNC_MODES}, got {mode!r}")
        self.generators = list(generators)
        self.directory = pathlib.Path(directory)
        self.mode = mode
        self.dtype = dtype
        self.ready_timeout_s = ready_timeout_s
        self.version = 0

    async def push(self, model, version: int) -> None:
        await sync_weights_via_disk(model, self.generators, self.directory, version=version, mode=self.mode,
                                    dtype=self.dtype, ready_timeout_s=self.ready_timeout_s)
        self.version = version


async def sync_weights_via_disk(model, generators: Sequence[SGLangGenerator], directory: str | os.PathLike, *,
                                version: int, mode: str = "abort", dtype=None, ready_timeout_s: float = 900.0) -> str:
    """Exports `model` as HF safetensors into `directory` and loads it on every server (see
    `DiskSync` for the modes), after waiting for any server not yet seen ready. Every server reports
    `version` afterwards. Returns the directory."""
    if mode not in DISK_SYNC_MODES:
        raise ValueError(f"sync_weights_via_disk: mode must be one of {DISK_SYNC_MODES}, got {mode!r}")
    # Every process takes part in the export's gathers (one writes). Under several processes the
    # writer process loads every server once the files are complete, and the others wait for it.
    if jax.process_count() > 1:
        path = save_pretrained(model, directory, dtype=dtype)  # collectives stay on this thread
        multihost.barrier(f"weights {version} exported")
        if not multihost.is_writer():
            multihost.barrier(f"weights {version} loaded")
            return os.fspath(path)
    else:
        path = await asyncio.to_thread(save_pretrained, model, directory, dtype=dtype)

    async def one(gen: SGLangGenerator):
        # The update is sent once (not idempotent): a server still loading must not receive it.
        if not gen.ready:
            await gen.wait_ready(ready_timeout_s)
        if mode == "pause":
            await gen.pause("abort")
            try:
                await gen.update_weights_from_disk(path, weight_version=version)
            finally:
                await gen.resume()
        else:
            await gen.update_weights_from_disk(path, abort_all_requests=mode == "abort", weight_version=version)

    await asyncio.gather(*(one(g) for g in generators))
    multihost.barrier(f"weights {version} loaded")
    return os.fspath(path)
