"""Sharded creation and placement of Qwen3 parameters from their logical axis names."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.model.sharding import DEFAULT_RULES, set_activation_shardings, state_shardings


def create_sharded_model(config: Qwen3Config, mesh: Mesh, rules=DEFAULT_RULES, seed: int = 0) -> Qwen3:
    """Initialises Qwen3 with every parameter created directly in its sharding.

    The initialiser runs under jit with explicit out shardings, so each device materialises only its
    shard and no host ever holds a full copy.
    """
    abstract = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)

    init = lambda: nnx.state(Qwen3(config, rngs=nnx.Rngs(seed)))  # noqa: E731
    if mesh.size == 1:
        # Measured: single-device out_shardings made the CPU train step 2-3x slower than plain jit.
        with jax.default_device(mesh.devices.flat[0]):
            state = jax.jit(init)()
    else:
        state = jax.jit(init, out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    return set_activation_shardings(model, mesh, rules)


def shard_model(model: Qwen3, mesh: Mesh, rules=DEFAULT_RULES) -> Qwen3:
    """Moves an existing model's parameters into their shardings on `mesh` (resharding as needed)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    return set_activation_shardings(nnx.merge(graphdef, state), mesh, rules)
