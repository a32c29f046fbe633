"""How the engine holds its weights: the layer layout (`rstar_jax.engine.settings.LAYER_LAYOUTS`).

`EngineWeights` is built once per engine from the model's split (real arrays, or abstract ones for an
ahead-of-time compile). The engine keeps `place(state)` of the stacked parameters (an `nnx.State`)
as its weights, and its jitted programs call `model(weights)` for the model and the per-layer
parameters to run it with:
- "stacked": the weights are the state itself; the model scans over its stacked layer parameters.
- "per_layer": the weights are `PerLayerWeights`: the embedding, final norm and LM head as they are,
  and each decoder layer's parameters as arrays of their own, cut from the stacked ones by one jitted
  program per weight update (`place`; its cost is a copy of the layer weights, once per update, not
  per step). Each layer's arrays keep the stacked array's sharding less its layer axis, so tensor
  and FSDP placements hold per layer. Inside the programs the model's stacked parameters are shapes
  only: nothing reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from rstar_jax.engine.settings import DEFAULT_LAYER_LAYOUT, LAYER_LAYOUTS
from rstar_jax.model.qwen3 import Qwen3, unstack_layers

LAYER_NAMES = frozenset(Qwen3.LAYER_PARAMS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PerLayerWeights:
    """The per-layer layout's weights: `rest`, the parameters outside the decoder layers (an
    `nnx.State`), and `layers`, one {name: array} per layer (`Qwen3.LAYER_PARAMS` names)."""

    rest: Any
    layers: tuple[dict[str, jax.Array], ...]


def _is_layer(path, _value) -> bool:
    return path[0] in LAYER_NAMES


def _name(path) -> str:
    return path[0].key  # the state's top-level key: the model attribute's name


def _layer_sharding(name: str, sharding):
    """One layer's slice of a stacked weight placed with `sharding`: the same placement less the
    layer axis."""
    if sharding is None or isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    raise ValueError(f"EngineWeights: {name} is placed with a {type(sharding).__name__}; the per_layer layout "
                     f"takes named or single-device placements")


def _shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


class EngineWeights:
    """The engine's weights in `layout`, for the model split as (`graphdef`, `state`)."""

    def __init__(self, graphdef, state: nnx.State, layout: str = DEFAULT_LAYER_LAYOUT):
        if layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout must be one of {LAYER_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.graphdef = graphdef
        # The stacked parameters' shapes, dtypes and placements: what an update must match, and where it goes.
        self.abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state)
        layer_state, self._rest_abstract = nnx.split_state(self.abstract, _is_layer, ...)
        named = jax.tree_util.tree_flatten_with_path(layer_state)[0]
        self._layer_treedef = jax.tree.structure(layer_state)
        self._leaf_names = tuple(_name(path) for path, _ in named)
        self._layer_abstract = {_name(path): x for path, x in named}
        # What the programs' models hold in place of the stacked layer parameters: shapes, never read.
        self._layer_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), layer_state)
        self.num_layers = next(iter(self._layer_abstract.values())).shape[0]
        self._unstack = self._restack = None
        if layout == "per_layer":
            one = {name: _layer_sharding(name, x.sharding) for name, x in self._layer_abstract.items()}
            stacked = {name: x.sharding for name, x in self._layer_abstract.items()}
            # Placed over a mesh: each layer's arrays as the stacked ones less the layer axis. Otherwise
            # (one device) the outputs follow the inputs, committed or not as the stacked parameters
            # are: the engine's programs are then called with what the stacked layout passes them, and
            # compile as often.
            named = all(isinstance(s, NamedSharding) for s in stacked.values())
            self._unstack = jax.jit(self._unstack_fn, out_shardings=(one,) * self.num_layers if named else None)
            self._restack = jax.jit(self._restack_fn, out_shardings=stacked if named else None)

    # -- the programs' side ---------------------------------------------------------------------
    def model(self, weights) -> tuple[Qwen3, tuple[dict[str, jax.Array], ...] | None]:
        """(model, layers) of `weights` inside a program: pass `layers` to the model's forwards."""
        if isinstance(weights, PerLayerWeights):
            return nnx.merge(self.graphdef, self._layer_shapes, weights.rest), weights.layers
        return nnx.merge(self.graphdef, weights), None

    # -- the host's side ------------------------------------------------------------------------
    def place(self, state: nnx.State):
        """The engine's weights from the stacked parameters `state`, already on the engine's
        placements (the per-layer layout copies the layer weights: once per update)."""
        if self._unstack is None:
            return state
        layer_state, rest = nnx.split_state(state, _is_layer, ...)
        return PerLayerWeights(rest=rest, layers=self._unstack(layer_state))

    def stacked(self, weights) -> nnx.State:
        """The stacked parameters of `weights` (for the per-layer layout, a new copy of the layer weights)."""
        if not isinstance(weights, PerLayerWeights):
            return weights
        stacked = self._restack(weights.layers)
        layer_state = jax.tree.unflatten(self._layer_treedef, [stacked[name] for name in self._leaf_names])
        return nnx.merge_state(layer_state, weights.rest)

    def abstract_weights(self):
        """`place` of the abstract state: shapes, dtypes and placements, for an ahead-of-time compile."""
        if self._unstack is None:
            return self.abstract
        layers = jax.eval_shape(self._unstack_fn, self._layer_abstract)
        one = {name: _layer_sharding(name, x.sharding) for name, x in self._layer_abstract.items()}
        layers = tuple({name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one[name]) for name, x in layer.items()}
                       for layer in layers)
        return PerLayerWeights(rest=self._rest_abstract, layers=layers)

    def extra_bytes_per_device(self) -> int:
        """The device memory the layout holds beside the model's own parameters (the tightest device):
        the per-layer copies of the layer weights, or nothing."""
        if self._unstack is None:
            return 0
        return sum(_shard_bytes(x) for x in self._layer_abstract.values())

    @staticmethod
    def _unstack_fn(layer_state) -> tuple[dict[str, jax.Array], ...]:
        named = jax.tree_util.tree_flatten_with_path(layer_state)[0]
        return unstack_layers({_name(path): x for path, x in named})

    @staticmethod
    def _restack_fn(layers) -> dict[str, jax.Array]:
        return {name: jax.numpy.stack([layer[name] for layer in layers]) for name in layers[0]}


def extra_bytes_per_device(model: Qwen3, layout: str) -> int:
    """What an engine in `layout` holds per device beside `model`'s parameters (its KV pool aside):
    size a pool by memory with it, before the engine exists."""
    return EngineWeights(*nnx.split(model), layout).extra_bytes_per_device()
