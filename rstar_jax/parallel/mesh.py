"""Device meshes over the axes ("data", "fsdp", "tensor").

The rules that place the model's logical axes on these mesh axes are in `rstar_jax.model.sharding`.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rstar_jax.model.sharding import MESH_AXES


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh; one size may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    for name, s in zip(MESH_AXES, sizes):
        if s != -1 and s < 1:
            raise ValueError(f"mesh.{name} must be >= 1 or -1, got {s}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh: data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = {int(np.prod(sizes))} "
            f"but {len(devices)} devices are available"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def maybe_initialize_distributed() -> None:
    """Joins a multi-process JAX job when launched as several processes: explicit
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`, or SLURM with more than one
    task (JAX reads the coordinator and ranks from SLURM's environment).

    `JAX_LOCAL_DEVICE_IDS` ("0,1,2,3") gives a process several local devices; without it JAX's
    SLURM detection gives each process the one device of its `SLURM_LOCALID` (run one task per
    GPU). `JAX_HEARTBEAT_TIMEOUT_S` (default 100) bounds how long the others wait for a process
    that died before they fail too.
    """
    explicit = bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if not explicit and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    options: dict = {"heartbeat_timeout_seconds": int(os.environ.get("JAX_HEARTBEAT_TIMEOUT_S", "100"))}
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        options["local_device_ids"] = [int(i) for i in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if explicit:
        options.update(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                       num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                       process_id=int(os.environ["JAX_PROCESS_ID"]))
    jax.distributed.initialize(**options)
