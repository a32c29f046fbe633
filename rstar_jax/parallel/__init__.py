"""Meshes, sharded initialisation and memory planning.

The logical-axis rules and the shardings they give (`DEFAULT_RULES`, `param_shardings`, ...) are the
model's own (`rstar_jax.model.sharding`) and are re-exported here. Names load lazily (PEP 562): a
config check imports `MESH_AXES` without jax, and `python -m rstar_jax.parallel.memory` runs its
module only once.
"""

from rstar_jax.lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it
    "DEFAULT_RULES": "rstar_jax.model.config",
    "MESH_AXES": "rstar_jax.model.config",
    "logical_sharding": "rstar_jax.model.sharding",
    "logical_to_spec": "rstar_jax.model.sharding",
    "param_shardings": "rstar_jax.model.sharding",
    "set_activation_shardings": "rstar_jax.model.sharding",
    "state_shardings": "rstar_jax.model.sharding",
    "make_mesh": "rstar_jax.parallel.mesh",
    "maybe_initialize_distributed": "rstar_jax.parallel.mesh",
    "create_sharded_model": "rstar_jax.parallel.sharding",
    "shard_model": "rstar_jax.parallel.sharding",
    "MemoryPlan": "rstar_jax.parallel.memory",
    "memory_plan": "rstar_jax.parallel.memory",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
