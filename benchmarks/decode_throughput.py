"""JaxEngine decode throughput beside the memory-bandwidth roofline and Hugging Face `generate`.

Runs `batch` greedy requests of `--prompt` tokens and `--new` new tokens each through one
JaxEngine (random-init preset), and times the whole run after a warm-up run of the same shapes.
Prints:
- engine decode tokens/s (batch x new tokens / wall time, prefill included);
- the roofline: every decode step must read all weights plus the KV cache it attends over
  (counted here as the whole context, prompt + new, of every row; the engine reads the pages that
  cover its longest live row, rounded up to 1/8, 1/4, 1/2 or all of the context), so
  steps/s <= bandwidth / (weight bytes + KV bytes) and tokens/s <= batch x that, with the copy
  bandwidth measured in this run (or --bandwidth);
- Hugging Face transformers `generate` (PyTorch, same config, random weights, greedy, same batch,
  prompt and lengths) measured in the same run, in its own process before ours so that it has the
  whole device, unless --no-hf.
--profile DIR writes a profiler trace of the timed engine run. `--layer-layout per_layer` runs the
engine with each layer's weights as arrays of their own (`rstar_jax.engine.settings`); the JSON's name
then carries the layout. `--decode-attention pallas` runs decode steps with the Pallas GPU
paged-attention kernel over a heads-first pool (in interpret mode off GPU: slow, a check only); the
JSON's name then carries it too.
With `--group G` the prompts come in groups of G identical ones (GRPO's 2G rollouts of one prompt),
and the same run also times an engine without prefix sharing: the prefill each engine computed and
the speed-up sharing gives.

    python benchmarks/decode_throughput.py --preset qwen3-1.7b --batch 64 --prompt 512 --new 256 --dtype bfloat16  # GPU
    python benchmarks/decode_throughput.py --preset tiny --batch 64                          # CPU
    python benchmarks/decode_throughput.py --preset tiny --batch 64 --group 32 --prompt 1024 --new 16 --no-hf
    python benchmarks/decode_throughput.py --preset qwen3-1.7b --batch 64 --prompt 512 --new 256 --dtype bfloat16 \
        --no-hf --layer-layout per_layer                                                   # GPU, per-layer weights
    python benchmarks/decode_throughput.py --preset qwen3-1.7b --batch 64 --prompt 512 --new 256 --dtype bfloat16 \
        --no-hf --decode-attention pallas                                                  # GPU, the Pallas kernel
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from rstar_jax.engine.jax_engine import JaxEngine  # noqa: E402
from rstar_jax.engine.settings import (  # noqa: E402
    DECODE_ATTENTIONS,
    DEFAULT_DECODE_ATTENTION,
    DEFAULT_LAYER_LAYOUT,
    LAYER_LAYOUTS,
)
from rstar_jax.rollout.protocol import SamplingParams  # noqa: E402

from ceilings import copy_bandwidth, hf_peer_config, run_peer  # noqa: E402 (benchmarks/ceilings.py)


class CompileCounter:
    """XLA backend compilations while `counting` (a public monitoring event): a timed run that
    compiles measures the compiler, not decode."""

    def __init__(self):
        self.count, self.counting = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if self.counting and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


def run_engine(engine: JaxEngine, prompts: list[list[int]], new: int) -> float:
    if not engine.flush_cache():  # each run starts cold: a prefix cached by the last run is not sharing
        raise RuntimeError("the engine is still busy with the previous run")
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0)

    async def go():
        # Every request is queued before the engine admits any, so that each run forms the same
        # prefill groups: admissions that follow arrival timing form groups (and compiled shapes)
        # the warm-up run never saw.
        engine.pause("in_place")
        requests = [asyncio.ensure_future(engine.generate(p, sampling)) for p in prompts]
        await asyncio.sleep(0)  # each task runs up to its first await: queued
        engine.resume()
        return await asyncio.gather(*requests)

    start = time.perf_counter()
    results = asyncio.run(go())
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results), "every request must produce --new tokens"
    return elapsed


def run_hf(config: Qwen3Config, prompts: np.ndarray, new: int, dtype: str) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.Qwen3ForCausalLM(hf_peer_config(config)).to(device=device, dtype=torch_dtype).eval()
    ids = torch.as_tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s for the roofline (default: the copy bandwidth measured in this run)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--group", type=int, default=1, help="identical prompts per group (GRPO's 2G rollouts); "
                                                             "> 1 also times an engine without prefix sharing")
    parser.add_argument("--layer-layout", default=DEFAULT_LAYER_LAYOUT, choices=LAYER_LAYOUTS,
                        help="how the engine holds the layer weights (default %(default)s)")
    parser.add_argument("--decode-attention", default=DEFAULT_DECODE_ATTENTION, choices=DECODE_ATTENTIONS,
                        help="how decode steps attend over the KV pool (default %(default)s)")
    parser.add_argument("--profile", metavar="DIR", help="write a profiler trace of the timed engine run to DIR")
    parser.add_argument("--only", choices=("ours", "peer"), help="run one side only (peer: HF generate)")
    parser.add_argument("--peer-json", help=argparse.SUPPRESS)  # where `--only peer` writes its figures
    args = parser.parse_args()
    if args.group < 1 or args.batch % args.group:
        parser.error(f"--group must be >= 1 and divide --batch ({args.batch}), got {args.group}")

    try:
        config = Qwen3Config.preset(args.preset, param_dtype=args.dtype, dtype=args.dtype)
    except ValueError as error:
        parser.error(f"--preset: {error}")
    max_length = args.prompt + args.new + 1
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(1, config.vocab_size, (args.batch // args.group, args.prompt)), args.group, axis=0)
    tokens = args.batch * args.new
    if args.only == "peer":
        hf = run_hf(config, prompts, args.new, args.dtype)
        if args.peer_json:
            with open(args.peer_json, "w") as f:
                json.dump(hf, f)
        return
    hf = None if args.no_hf or args.only == "ours" else run_peer(__file__, sys.argv[1:])

    model = Qwen3(config, rngs=nnx.Rngs(0))
    # With groups, a follower prefills only its last partial page: its shape needs a small bucket.
    buckets = (args.prompt,) if args.group == 1 else tuple(b for b in (16, 64, 256) if b < args.prompt) + (args.prompt,)

    def timed(profile: str | None = None, **options) -> tuple[float, JaxEngine]:
        engine = JaxEngine(model, slots=args.batch, max_length=max_length, prefill_buckets=buckets,
                           layer_layout=args.layer_layout, decode_attention=args.decode_attention, **options)
        try:
            run_engine(engine, prompts.tolist(), args.new)  # compile
            engine.prompt_tokens = engine.cached_tokens = engine.shared_tokens = engine.shared_pages = 0
            COMPILES.count, COMPILES.counting = 0, True
            try:
                with jax.profiler.trace(profile) if profile else contextlib.nullcontext():
                    return run_engine(engine, prompts.tolist(), args.new), engine
            finally:
                COMPILES.counting = False
        finally:
            engine.close()

    elapsed, engine = timed(args.profile)
    ours = tokens / elapsed

    bandwidth = args.bandwidth or copy_bandwidth()
    itemsize = np.dtype(jax.numpy.dtype(args.dtype)).itemsize
    weight_bytes = config.num_params * itemsize
    kv_bytes = 2 * config.num_layers * args.batch * max_length * config.num_kv_heads * config.head_dim * itemsize
    roofline = args.batch * bandwidth / (weight_bytes + kv_bytes)
    print(f"device: {jax.devices()[0].device_kind}; preset {args.preset} ({config.num_params / 1e6:.1f}M params, "
          f"{args.dtype}); batch {args.batch}, prompt {args.prompt}, new {args.new}; layer layout {args.layer_layout}; decode attention {args.decode_attention}")
    compiles = COMPILES.count
    print(f"JaxEngine:        {ours:10.0f} tokens/s ({elapsed:.2f} s; {compiles} compilations in the timed run"
          f"{'' if not compiles else ': the figure includes compile time'})")
    result = {"device": jax.devices()[0].device_kind, "args": vars(args), "tokens_per_s": ours, "seconds": elapsed,
              "bandwidth": bandwidth, "roofline_tokens_per_s": roofline, "timed_run_compiles": compiles}
    if args.group > 1:
        unshared_elapsed, unshared = timed(prefix_sharing=False)
        prefilled = lambda e: e.prompt_tokens - e.cached_tokens  # noqa: E731
        print(f"prefix sharing:   groups of {args.group} identical prompts: prefilled {prefilled(engine)} prompt tokens "
              f"({engine.shared_pages} pages shared) against {prefilled(unshared)} without sharing; "
              f"{unshared_elapsed:.2f} s without -> {unshared_elapsed / elapsed:.2f}x")
    source = "given" if args.bandwidth else "copy measured in this run"
    print(f"roofline:         {roofline:10.0f} tokens/s (weights {weight_bytes / 1e9:.3f} GB + KV {kv_bytes / 1e9:.3f} GB "
          f"per step at {bandwidth / 1e12:.2f} TB/s, {source}) -> {100 * ours / roofline:.1f}% of roofline")
    if hf:
        result["hf"] = hf
        rate = tokens / hf["seconds"]
        print(f"HF generate:      {rate:10.0f} tokens/s ({hf['seconds']:.2f} s; torch {hf['torch']}) "
              f"-> JaxEngine / HF = {ours / rate:.2f}x")
    if os.environ.get("OUT"):
        layout = "" if args.layer_layout == DEFAULT_LAYER_LAYOUT else f"_{args.layer_layout}"
        layout += "" if args.decode_attention == DEFAULT_DECODE_ATTENTION else f"_{args.decode_attention}"
        name = f"decode_{args.preset}_B{args.batch}{layout}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
