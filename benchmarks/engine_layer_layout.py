"""JaxEngine's two layer layouts side by side: "stacked" (the decode and prefill programs scan over
[layers, ...] weights) against "per_layer" (each layer's weights their own arrays, the layers
unrolled; `rstar_jax.engine.settings`).

For each depth in `--layers` and each layout, one engine runs `--batch` greedy requests of
`--prompt` tokens and `--new` new tokens each, all admitted together (one prefill group), twice: the
first run compiles, the second is timed. Printed per row:
- compile seconds of the prefill and decode programs (tracing, lowering to MLIR and XLA's
  compilation, from jax.monitoring's compile events, attributed by the program's function), and the
  number of XLA compilations of each; the persistent compilation cache is off;
- the per-step time of the timed run (its seconds / --new: decode steps, prefill included), the
  sanity ratio on CPU and the figure that matters on a GPU;
- the weight sync: seconds of `update_weights` with the same (ready) parameters, the per-layer
  layout's cut of the layer weights included (its own compile excluded: measured on the second
  update), and the bytes the layout holds beside the model;
- dynamic-slice and copy instructions in the compiled decode program (XLA's optimized HLO): the
  stacked scan slices every layer weight out of its stacked array each layer-step, which on GPU
  became 7 memcpys per layer-step (19% of an H100's decode step for Qwen3-1.7B at batch 64).
The last line compares the deepest configuration: `per_layer_vs_stacked_compile` is the ratio of
prefill + decode compile seconds, `per_layer_vs_stacked_decode` the ratio of step times (below 1:
per_layer decodes faster).

    python benchmarks/engine_layer_layout.py                           # CPU: tiny width, 2, 8 and 28 layers
    python benchmarks/engine_layer_layout.py --preset qwen3-1.7b --layers 28 --dtype bfloat16 \\
        --batch 64 --prompt 512 --new 256                              # GPU (gpu_suite.sh --layer-layout)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstar_jax.engine.jax_engine import JaxEngine  # noqa: E402
from rstar_jax.engine.settings import LAYER_LAYOUTS  # noqa: E402
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from rstar_jax.rollout.protocol import SamplingParams  # noqa: E402

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
PROGRAMS = {"prefill_step": "prefill", "decode_step": "decode"}


class CompileLog:
    """Compile seconds and XLA compilations per program while `recording` (jax.monitoring events)."""

    def __init__(self):
        self.seconds, self.count = collections.Counter(), collections.Counter()
        self.recording = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if not self.recording or event not in COMPILE_EVENTS:
            return
        name = str(kwargs.get("fun_name", ""))  # "decode_step" when traced, "jit(decode_step)" after
        program = PROGRAMS.get(name.removeprefix("jit(").removesuffix(")"), "other")
        self.seconds[program] += duration
        if event == COMPILE_EVENTS[-1]:
            self.count[program] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.count.clear()


COMPILES = CompileLog()


def run(engine: JaxEngine, prompts: list[list[int]], new: int) -> float:
    if not engine.flush_cache():
        raise RuntimeError("the engine is still busy")
    greedy = SamplingParams(max_new_tokens=new, temperature=0.0)

    async def go():
        engine.pause("in_place")  # every request queued before any is admitted: one prefill group
        tasks = [asyncio.ensure_future(engine.generate(p, greedy)) for p in prompts]
        await asyncio.sleep(0)
        engine.resume()
        return await asyncio.gather(*tasks)

    start = time.perf_counter()
    results = asyncio.run(go())
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results)
    return elapsed


class DecodeShapes:
    """Wraps the engine's (greedy) decode program and keeps the shapes of its last call, for the
    compiled program's HLO (`hlo_counts`)."""

    def __init__(self, engine: JaxEngine):
        self.jitted, self.args = engine._decode[False], None
        engine._decode = {**engine._decode, False: self}

    def __call__(self, *args):
        self.args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                 if isinstance(x, jax.Array) else x, args)
        return self.jitted(*args)

    def hlo_counts(self) -> tuple[int, int]:
        """(dynamic-slice, copy) instructions, fused ones included, in the optimized HLO."""
        text = self.jitted.lower(*self.args).compile().as_text()
        return len(re.findall(r"= \S+ dynamic-slice\(", text)), len(re.findall(r"= \S+ copy\(", text))


def measure(config: Qwen3Config, layout: str, args) -> dict:
    model = Qwen3(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (args.batch, args.prompt)).tolist()
    COMPILES.reset()
    COMPILES.recording = True
    engine = JaxEngine(model, slots=args.batch, max_length=args.prompt + args.new + 1, page_size=args.page_size,
                       prefill_buckets=(args.prompt,), layer_layout=layout)
    try:
        decode = DecodeShapes(engine)
        run(engine, prompts, args.new)  # compiles
        COMPILES.recording = False
        seconds, count = dict(COMPILES.seconds), dict(COMPILES.count)
        step_s = min(run(engine, prompts, args.new) for _ in range(args.repeats)) / args.new
        state = nnx.state(model)
        engine.update_weights(state)  # the first update compiles the per-layer cut
        jax.block_until_ready(engine._weights)
        start = time.perf_counter()
        engine.update_weights(state)
        jax.block_until_ready(engine._weights)
        sync_s = time.perf_counter() - start
        slices, copies = decode.hlo_counts() if args.hlo else (-1, -1)
        return {"layers": config.num_layers, "layout": layout, "prefill_compile_s": seconds.get("prefill", 0.0),
                "decode_compile_s": seconds.get("decode", 0.0), "other_compile_s": seconds.get("other", 0.0),
                "prefill_compiles": count.get("prefill", 0), "decode_compiles": count.get("decode", 0),
                "other_compiles": count.get("other", 0), "step_s": step_s, "sync_s": sync_s,
                "extra_weight_bytes": engine.extra_weight_bytes, "decode_dynamic_slices": slices,
                "decode_copies": copies}
    finally:
        COMPILES.recording = False
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", default=None,
                        help="comma-separated depths (default: 2,8,28 for tiny, else the preset's own)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (the fastest counts)")
    parser.add_argument("--no-hlo", dest="hlo", action="store_false", help="skip the decode program's HLO counts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # compile seconds, not cache reads
    base = Qwen3Config.preset(args.preset, param_dtype=args.dtype, dtype=args.dtype)
    depths = ([int(x) for x in args.layers.split(",")] if args.layers
              else [2, 8, 28] if args.preset == "tiny" else [base.num_layers])
    device = jax.devices()[0]
    print(f"engine layer layouts: preset {args.preset} (hidden {base.hidden_size}, intermediate "
          f"{base.intermediate_size}), {args.dtype}; batch {args.batch}, prompt {args.prompt}, new {args.new}, "
          f"page {args.page_size}; {device.platform} ({device.device_kind}); jax {jax.__version__}", flush=True)
    header = (f"{'layers':>6} {'layout':<10} {'prefill s':>9} {'decode s':>9} {'other s':>8} {'compiles p/d/o':>15} "
              f"{'step ms':>9} {'sync ms':>9} {'extra MiB':>10} {'dyn-slices':>10} {'copies':>7}")
    print(header, flush=True)
    rows = []
    for depth in depths:
        config = Qwen3Config.preset(args.preset, param_dtype=args.dtype, dtype=args.dtype, num_layers=depth)
        for layout in LAYER_LAYOUTS:
            r = measure(config, layout, args)
            rows.append(r)
            compiles = f"{r['prefill_compiles']}/{r['decode_compiles']}/{r['other_compiles']}"
            print(f"{depth:>6} {layout:<10} {r['prefill_compile_s']:>9.2f} {r['decode_compile_s']:>9.2f} "
                  f"{r['other_compile_s']:>8.2f} {compiles:>15} {1e3 * r['step_s']:>9.2f} {1e3 * r['sync_s']:>9.2f} "
                  f"{r['extra_weight_bytes'] / 2**20:>10.1f} {r['decode_dynamic_slices']:>10} {r['decode_copies']:>7}",
                  flush=True)
    deepest = {r["layout"]: r for r in rows if r["layers"] == depths[-1]}
    stacked, per_layer = deepest["stacked"], deepest["per_layer"]

    def compile_s(r):
        return r["prefill_compile_s"] + r["decode_compile_s"]

    compile_ratio = compile_s(per_layer) / compile_s(stacked)
    decode_ratio = per_layer["step_s"] / stacked["step_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device.device_kind, "jax": jax.__version__, "rows": rows,
                       "per_layer_vs_stacked_compile": compile_ratio, "per_layer_vs_stacked_decode": decode_ratio},
                      f, indent=2)
    print(f"at {depths[-1]} layers, per_layer / stacked: prefill + decode compile seconds, then step time "
          f"(below 1: per_layer faster)")
    print(f"per_layer_vs_stacked_compile={compile_ratio:.2f} per_layer_vs_stacked_decode={decode_ratio:.2f}")


if __name__ == "__main__":
    main()
