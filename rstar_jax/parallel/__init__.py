"""Meshes, sharded initialisation and memory planning.

The logical-axis rules and the shardings they give (`DEFAULT_RULES`, `param_shardings`, ...) are the
model's own (`rstar_jax.model.sharding`) and are re-exported here.
"""

from rstar_jax.model.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    logical_sharding,
    logical_to_spec,
    param_shardings,
    set_activation_shardings,
    state_shardings,
)
from rstar_jax.parallel.mesh import make_mesh, maybe_initialize_distributed
from rstar_jax.parallel.sharding import create_sharded_model, shard_model

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "make_mesh", "maybe_initialize_distributed", "logical_sharding", "logical_to_spec",
    "MemoryPlan", "memory_plan", "create_sharded_model", "param_shardings",
    "state_shardings", "shard_model", "set_activation_shardings",
]


def __getattr__(name):
    # Imported lazily so that `python -m rstar_jax.parallel.memory` runs its module only once.
    if name in ("MemoryPlan", "memory_plan"):
        from rstar_jax.parallel import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'rstar_jax.parallel' has no attribute {name!r}")
