"""Per-device memory plan for parameters, gradients and optimizer state of a preset on a mesh.

    python -m rstar_jax.parallel.memory --preset qwen3-14b --data 1 --fsdp 64 --tensor 1
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from rstar_jax.model.qwen3 import Qwen3Config, abstract_model, dtype_name
from rstar_jax.model.sharding import DEFAULT_RULES, MESH_AXES, rules_dict

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    preset: str
    mesh_shape: dict[str, int]
    num_params: int
    param_bytes: int  # per device
    grad_bytes: int
    opt_state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.opt_state_bytes

    def __str__(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        rows = [("parameters", self.param_bytes), ("gradients", self.grad_bytes),
                ("optimizer state", self.opt_state_bytes), ("total", self.total_bytes)]
        lines = [f"memory plan: {self.preset} ({self.num_params / 1e9:.3f}B parameters), mesh {mesh}",
                 f"{'per device':<18}{'GiB':>10}"]
        lines += [f"{name:<18}{b / GIB:>10.3f}" for name, b in rows]
        return "\n".join(lines)


def _shard_factor(shape, logical_axes, rules, mesh_shape) -> int:
    """How many ways a parameter is split (same divisibility rule as the real sharding)."""
    table = rules_dict(rules)
    used: set[str] = set()
    factor = 1
    for dim, name in enumerate(logical_axes):
        axes = table.get(name)
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used and mesh_shape[a] > 1)
        size = int(np.prod([mesh_shape[a] for a in axes])) if axes else 1
        if axes and shape[dim] % size == 0:
            used.update(axes)
            factor *= size
    return factor


def memory_plan(
    config: Qwen3Config,
    mesh_shape: dict[str, int] | Mesh,
    *,
    rules=DEFAULT_RULES,
    param_dtype: DTypeLike | None = None,
    grad_dtype: DTypeLike | None = None,
    opt_state_dtype: DTypeLike = "float32",
    optimizer: str = "adamw",
    preset: str = "",
) -> MemoryPlan:
    """Bytes per device; shards are rounded up to whole elements (as XLA pads uneven shards).

    Dtypes are names or JAX/NumPy dtypes; parameters default to `config.param_dtype` and gradients
    to the parameters' dtype.
    """
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"memory_plan: optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    if isinstance(mesh_shape, Mesh):
        mesh_shape = dict(mesh_shape.shape)
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"memory_plan: unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
    mesh_shape = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
    param_dtype = dtype_name(config.param_dtype if param_dtype is None else param_dtype, "memory_plan.param_dtype")
    grad_dtype = dtype_name(param_dtype if grad_dtype is None else grad_dtype, "memory_plan.grad_dtype")
    opt_state_dtype = dtype_name(opt_state_dtype, "memory_plan.opt_state_dtype")
    p_size, g_size, o_size = (jnp.dtype(d).itemsize for d in (param_dtype, grad_dtype, opt_state_dtype))
    moments = 2 if optimizer == "adamw" else 0
    per_device_elems = 0
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(abstract_model(config), nnx.Param)):
        n = int(np.prod(var.shape))
        total += n
        factor = _shard_factor(var.shape, var.get_metadata()["logical_axes"], rules, mesh_shape)
        per_device_elems += -(-n // factor)
    return MemoryPlan(
        preset=preset or "custom",
        mesh_shape=mesh_shape,
        num_params=total,
        param_bytes=per_device_elems * p_size,
        grad_bytes=per_device_elems * g_size,
        opt_state_bytes=per_device_elems * o_size * moments,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-14b")
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--param-dtype", default="float32")
    parser.add_argument("--grad-dtype", default=None)
    parser.add_argument("--opt-state-dtype", default="float32")
    args = parser.parse_args(argv)
    config = Qwen3Config.preset(args.preset)
    plan = memory_plan(config, {"data": args.data, "fsdp": args.fsdp, "tensor": args.tensor},
                       param_dtype=args.param_dtype, grad_dtype=args.grad_dtype,
                       opt_state_dtype=args.opt_state_dtype, preset=args.preset)
    print(plan)


if __name__ == "__main__":
    main()
