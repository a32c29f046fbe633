"""Device meshes and the logical-axis rules that place parameters and activations on them."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or axes, or None = replicated). Weights are FSDP-sharded on the
# embedding dimension and tensor-parallel on heads / MLP / vocabulary; activations are sharded on
# the batch over both data-parallel axes.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
)


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


def _rules_dict(rules) -> dict:
    out = {}
    for entry in rules:
        name, axes = entry
        out[name] = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    return out


def logical_to_spec(logical_axes: Sequence[str | None], rules, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """Maps logical names to a PartitionSpec.

    A mesh axis is used at most once per array (first dimension wins), and when `shape` and `mesh`
    are given, a dimension not divisible by its mesh axes' size stays replicated (e.g. 8 KV heads on a
    16-way tensor axis).
    """
    table = _rules_dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no entry in the sharding rules {sorted(table)}")
        axes = table.get(name) if name is not None else None
        if axes is None:
            spec.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used)
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if shape is not None and axes:
                size = int(np.prod([mesh.shape[a] for a in axes]))
                if shape[dim] % size:
                    axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules=DEFAULT_RULES,
                     shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh, shape))
