"""How the model's logical axes land on a device mesh.

Every parameter carries logical axis names (metadata ``logical_axes``) and the main activations have
fixed logical layouts (`ACTIVATION_AXES`); a rules table maps those names to the mesh axes
("data", "fsdp", "tensor"). The loader places checkpoints with these alone; building meshes,
sharded initialisation and memory plans are in the `parallel` package, which imports this module
(never the reverse). `MESH_AXES` and `DEFAULT_RULES` live in `rstar_jax.model.config`, so that
configs are checked without jax, and are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar_jax.model.config import DEFAULT_RULES, MESH_AXES  # jax-free, for config checks; re-exported

if TYPE_CHECKING:
    from rstar_jax.model.qwen3 import Qwen3

# Main activations: [batch, length, embed] and [batch, length, heads, head_dim].
ACTIVATION_AXES = {
    "act_btd": ("batch", "length", "embed_act"),
    "act_bthd": ("batch", "length", "heads", "head_dim"),
}


def rules_dict(rules) -> dict:
    """A rules table as {logical name: mesh axis, tuple of axes, or None}."""
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
    table = rules_dict(rules)
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


def param_shardings(state_or_model, mesh: Mesh, rules=DEFAULT_RULES) -> dict[str, NamedSharding]:
    """NamedSharding of every parameter (by attribute name) from its `logical_axes` metadata."""
    state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model, nnx.Param)
    out = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        if "logical_axes" not in meta:
            continue
        name = ".".join(str(p) for p in path)
        out[name] = logical_sharding(mesh, meta["logical_axes"], rules, var.shape)
    return out


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """A pytree of shardings matching `state` (parameters sharded, everything else replicated)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if mesh.size == 1:
        # One device: plain single-device arrays keep XLA off the (slower on CPU) SPMD path.
        single = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
        return jax.tree.map(lambda v: v.replace(single), state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def one(var):
        meta = var.get_metadata()
        if "logical_axes" in meta:
            return var.replace(logical_sharding(mesh, meta["logical_axes"], rules, var.shape))
        return var.replace(replicated)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def set_activation_shardings(model: Qwen3, mesh: Mesh, rules=DEFAULT_RULES) -> Qwen3:
    """Constrains the model's main activations (batch over the data-parallel axes)."""
    if mesh.size == 1:
        model.activation_shardings = ()
        return model
    # The residual stream's embed dim stays unsharded within a layer (FSDP shards weights only).
    rules = tuple(rules) + (("embed_act", None),)
    model.activation_shardings = tuple(
        (kind, logical_sharding(mesh, axes, rules)) for kind, axes in ACTIVATION_AXES.items()
    )
    return model


__all__ = [
    "MESH_AXES", "DEFAULT_RULES", "ACTIVATION_AXES", "rules_dict", "logical_to_spec", "logical_sharding",
    "param_shardings", "state_shardings", "set_activation_shardings",
]
