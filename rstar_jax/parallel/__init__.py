"""Meshes, logical-axis rules, sharded initialisation and memory planning."""

from rstar_jax.parallel.mesh import DEFAULT_RULES, MESH_AXES, logical_sharding, logical_to_spec, make_mesh
from rstar_jax.parallel.sharding import (
    create_sharded_model,
    model_shardings,
    param_shardings,
    set_activation_shardings,
    shard_model,
    state_shardings,
)

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "make_mesh", "logical_sharding", "logical_to_spec",
    "MemoryPlan", "memory_plan", "create_sharded_model", "model_shardings", "param_shardings",
    "state_shardings", "shard_model", "set_activation_shardings",
]


def __getattr__(name):
    # Imported lazily so that `python -m rstar_jax.parallel.memory` runs its module only once.
    if name in ("MemoryPlan", "memory_plan"):
        from rstar_jax.parallel import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'rstar_jax.parallel' has no attribute {name!r}")
