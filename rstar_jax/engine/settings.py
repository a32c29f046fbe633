"""The engine's settings that configs name, without JAX (checking a config imports none).

Layer layouts (`JaxEngine(layer_layout=...)`, `config.rollout.engine.layer_layout`,
`python -m rstar_jax.serve --layer-layout`), how the engine holds the decoder layers' weights:
- "stacked": as the model holds them, [layers, ...] per weight, and the prefill and decode programs
  scan over the layers. Compiles once per shape whatever the depth; on GPU each layer-step copies
  its slice of every stacked weight matrix before the GEMMs read it.
- "per_layer": each layer's weights their own arrays (made from the stacked ones at every weight
  update), and the programs loop over the layers in Python: no slice, no copy; the programs are
  unrolled, so they compile in time that grows with the depth. The layer weights take memory of
  their own beside the model's stacked ones (`rstar_jax.engine.weights.extra_bytes_per_device`).
"""

from __future__ import annotations

LAYER_LAYOUTS = ("stacked", "per_layer")
DEFAULT_LAYER_LAYOUT = "stacked"  # until a GPU measurement shows "per_layer" faster (benchmarks/RESULTS.md)
