"""How the model's logical axes land on a device mesh, of either axis type.

Every parameter carries logical axis names (metadata ``logical_axes``) and the main activations have
fixed logical layouts (`ACTIVATION_AXES`); a rules table maps those names to the mesh axes
("data", "fsdp", "tensor"). The loader places checkpoints with these alone; building meshes,
sharded initialisation and memory plans are in the `parallel` package, which imports this module
(never the reverse). `MESH_AXES` and `DEFAULT_RULES` live in `rstar_jax.model.config`, so that
configs are checked without jax, and are re-exported here.

A mesh's axes are Auto (XLA's partitioner places what is not constrained: `Mesh`'s default, and
`rstar_jax.parallel.make_mesh`'s) or Explicit (every array's sharding is part of its type:
`jax.make_mesh`'s default since jax 0.10). `constrain`, `type_sharding` and `gather_axes` are the
model's one place that tells them apart, so it runs on meshes of either type (`rstar_jax.rl`,
which imports no other layer, has its own copy for the log-prob head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rstar_jax.model.config import DEFAULT_RULES, MESH_AXES  # jax-free, for config checks; re-exported

if TYPE_CHECKING:
    from rstar_jax.model.qwen3 import Qwen3

# Main activations: [batch, length, embed] and [batch, length, heads, head_dim].
ACTIVATION_AXES = {
    "act_btd": ("batch", "length", "embed_act"),
    "act_bthd": ("batch", "length", "heads", "head_dim"),
}


def spec_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]):
    """The PartitionSpec entry of a sequence of mesh axis names (the inverse of `spec_axes`)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def batch_axes(sharding) -> tuple[str, ...]:
    """The mesh axes that shard dimension 0 (the batch) under `sharding`; none for None."""
    return spec_axes((tuple(sharding.spec) + (None,))[0]) if sharding is not None else ()


def explicit_axes(sharding) -> frozenset[str]:
    """The Explicit axes of a sharding's mesh (a NamedSharding, or an array type's sharding)."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", None) or ()
    return frozenset(name for name, t in zip(getattr(mesh, "axis_names", ()), types) if t == AxisType.Explicit)


def type_sharding(x) -> NamedSharding | None:
    """`x`'s sharding when its type carries one (Explicit axes), else None. It is the `out_sharding`
    of an op whose output JAX cannot infer there (an einsum contracting a sharded dimension): under
    Auto axes None lets XLA choose, as before."""
    sharding = jax.typeof(x).sharding
    return sharding if explicit_axes(sharding) else None


def constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Lays `x` out as `sharding` on either axis type: `with_sharding_constraint` on Auto axes (a
    hint XLA's partitioner follows), `reshard` on Explicit ones (there `with_sharding_constraint` only
    asserts the type). On a mesh mixing both, only its Explicit axes are kept."""
    explicit = explicit_axes(sharding)
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    spec = PartitionSpec(*(spec_entry([a for a in spec_axes(e) if a in explicit]) for e in sharding.spec))
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))


def gather_axes(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Under Explicit axes, `x` resharded without mesh `axes` (an FSDP-sharded weight gathered over
    the axes that shard the batch, before it is used); unchanged under Auto axes, where XLA's
    partitioner gathers it itself."""
    sharding = type_sharding(x)
    if sharding is None or not set(axes) & {a for e in sharding.spec for a in spec_axes(e)}:
        return x
    spec = PartitionSpec(*(spec_entry([a for a in spec_axes(e) if a not in axes]) for e in sharding.spec))
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))


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
    "MESH_AXES", "DEFAULT_RULES", "ACTIVATION_AXES", "spec_axes", "spec_entry", "batch_axes", "explicit_axes",
    "type_sharding", "constrain", "gather_axes", "rules_dict", "logical_to_spec", "logical_sharding",
    "param_shardings", "state_shardings", "set_activation_shardings",
]
