"""SGLang's KV pool sizing from `mem_fraction_static`, for `python -m rstar_jax.serve` and the
in-process engine (`builders.make_engine`). Messages name the flags or config fields behind the
numbers (`SERVE_NAMES`, `CONFIG_NAMES`)."""

from __future__ import annotations

import logging
import os
from typing import Callable

from rstar_jax.errors import UserError

log = logging.getLogger(__name__)

# What each message calls the fraction, the pool override, the context length and the fallback.
SERVE_NAMES = {"fraction": "--mem-fraction-static", "pool": "--max-total-tokens", "context": "--context-length",
               "fallback": "max-running-requests x context-length"}
CONFIG_NAMES = {"fraction": "config.rollout.engine.mem_fraction_static",
                "pool": "config.rollout.engine.max_total_tokens", "context": "config.rollout.engine.max_length",
                "fallback": "slots x max_length"}


def kv_pool_tokens(model, mesh, *, mem_fraction: float, context_length: int, fallback: int,
                   names: dict[str, str] = SERVE_NAMES, report: Callable[[str], None] | None = None,
                   reserved_bytes: int = 0) -> int:
    """SGLang's KV pool sizing: `mem_fraction` of each device's memory limit holds the weights and
    the pool, so the pool gets that fraction less what is in use after loading (the tightest device
    decides) and less `reserved_bytes` per device that the engine will hold beside them (its
    per-layer weight copies, `rstar_jax.engine.weights.extra_bytes_per_device`). `fallback` where a
    device reports no memory statistics (CPU); refused when it would not fit `mem_fraction` of the
    host's memory, where that is known. `mesh` None: the default device. `report` (default: this
    module's logger) receives the sizing line."""
    import jax  # here: `python -m rstar_jax.serve --help` imports this module, and needs no JAX
    import jax.numpy as jnp

    report = report or log.info
    c = model.config
    tensor = mesh.shape.get("tensor", 1) if mesh is not None else 1
    shards = tensor if c.num_kv_heads % tensor == 0 else 1  # the pool's KV heads are split as `pool_sharding`
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize / shards
    gib = 2 ** 30
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    stats = [d.memory_stats() for d in devices]
    fraction, pool_name, context = names["fraction"], names["pool"], names["context"]
    if any(not s or "bytes_limit" not in s for s in stats):
        pool = fallback * per_token * len(devices)
        host = _host_memory_bytes()
        if host is not None and pool > mem_fraction * host:
            raise UserError(f"a KV pool of {names['fallback']} = {fallback} tokens needs "
                            f"{pool / gib:.1f} GiB, more than {fraction} {mem_fraction} of this host's "
                            f"{host / gib:.1f} GiB; pass {pool_name}, or lower {context}")
        report(f"{devices[0].platform} reports no memory statistics: KV pool of {names['fallback']} = {fallback} "
               f"tokens ({pool / gib:.2f} GiB; pass {pool_name} to choose)")
        return fallback
    free = min(mem_fraction * s["bytes_limit"] - s["bytes_in_use"] for s in stats) - reserved_bytes
    tokens = int(free // per_token)
    if tokens < context_length:
        limit, used = stats[0]["bytes_limit"] / gib, stats[0]["bytes_in_use"] / gib
        reserved = f" and {reserved_bytes / gib:.1f} GiB of per-layer weights" if reserved_bytes else ""
        raise UserError(f"{fraction} {mem_fraction}: {mem_fraction} x {limit:.1f} GiB leaves room for "
                        f"{max(tokens, 0)} KV tokens beside {used:.1f} GiB in use{reserved}, below one request's "
                        f"context ({context_length}); raise it, or lower {context}")
    reserved = f" and {reserved_bytes / gib:.2f} GiB of per-layer weights" if reserved_bytes else ""
    report(f"KV pool of {tokens} tokens ({tokens * per_token / gib:.2f} GiB per device): {fraction} {mem_fraction} "
           f"of {stats[0]['bytes_limit'] / gib:.1f} GiB, less {stats[0]['bytes_in_use'] / gib:.1f} GiB in use"
           f"{reserved}")
    return tokens


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX host
        return None
