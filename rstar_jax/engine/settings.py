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

Decode attention (`JaxEngine(decode_attention=...)`, `config.rollout.engine.decode_attention`,
`python -m rstar_jax.serve --decode-attention`), how a decode step attends over the KV pool:
- "xla": each row's pages gathered from a [layers, pages, page_size, kv_heads, head_dim] pool, then
  a multiply-reduce over them (`rstar_jax.model.qwen3.single_query_attention`).
- "pallas": the Pallas GPU kernel `jax.experimental.pallas.ops.gpu.paged_attention` reads the pages
  where they lie, from a pool laid out heads first ([kv_heads, layers, pages, page_size, head_dim]:
  the kernel's layout for every layer, read without a per-layer copy or transpose;
  `rstar_jax.model.paged_attention`); under a mesh with tensor > 1 it runs per device on that
  device's KV heads (`jax.shard_map`). Prefill keeps the XLA path (over the same pool). It needs a
  power-of-two head_dim (>= 16) and page_size, KV heads that divide over the tensor axis and a
  float pool; other shapes are refused when the engine is built. On a backend other than GPU the
  kernel runs in Pallas interpret mode: the same outputs, slowly; it is there for tests.
"""

from __future__ import annotations

LAYER_LAYOUTS = ("stacked", "per_layer")
DEFAULT_LAYER_LAYOUT = "stacked"  # until a GPU measurement shows "per_layer" faster (benchmarks/RESULTS.md)

DECODE_ATTENTIONS = ("xla", "pallas")
DEFAULT_DECODE_ATTENTION = "xla"  # until a GPU measurement shows "pallas" faster (benchmarks/RESULTS.md)
