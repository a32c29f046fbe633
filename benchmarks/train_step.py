"""Full GRPO train step throughput: tokens/s, MFU and peak memory, beside a PyTorch peer.

    python benchmarks/train_step.py --preset qwen3-1.7b --batch 4 --length 4096   # on a GPU
    python benchmarks/train_step.py --preset small --batch 2 --length 512         # CPU smoke size

Ours: `rstar_jax.train.step.train_step` (policy forward -> chunked log-probs -> GRPO loss -> grads
-> AdamW) with the batch placed as the RL trainer places it (`place_batch`: rows over the mesh's
data-parallel axes) and the optimizer as `make_optimizer` builds it. On a GPU by default: bf16
compute, fp32 parameters, remat "full", cuDNN attention (--compute-dtype, --param-dtype, --remat,
--attention, --micro-batches and --chunk change them; --master-weights float32 with --param-dtype
bfloat16 keeps an fp32 master copy in the optimizer state, `optim.master_weights`). --compile-only prints XLA's memory analysis
of the step for abstract arrays instead, on any backend.
Peer (same shapes, its own process, run first so that it has the whole device): Hugging Face
`Qwen3ForCausalLM` in PyTorch, forward + backward of a full-vocabulary log-softmax token loss (what
`../shared/bench/hf_qwen3_peer.py torch` measures), gradient checkpointing on GPU. --no-peer skips it.

MFU counts model FLOPs only: 6·N·tokens + causal attention 6·L·H·hd·T per token (fwd + bwd, halved
for causality); recomputation is not useful work. The peak is 989 TFLOP/s (dense bf16) on an H100 or
H200, otherwise a matmul peak measured in this run; on a GPU the bf16 matmul peak measured in this
run is printed beside it. --profile DIR writes a profiler trace of two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model.qwen3 import REMAT_POLICIES, Qwen3Config
from rstar_jax.model.sharding import DEFAULT_RULES
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.app.aot import abstract_policy_for, compile_grpo_update
from rstar_jax.train.step import OptimizerConfig, make_optimizer, place_batch, train_step

from ceilings import hf_peer_config, matmul_peak, mfu_peak, run_peer  # noqa: E402 (benchmarks/ceilings.py)


def model_flops(config: Qwen3Config, tokens: int, length: int) -> float:
    attention = 6 * config.num_layers * config.num_heads * config.head_dim * length
    return 6 * config.num_params * tokens + attention * tokens


def small_preset() -> Qwen3Config:
    return Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64)


def run_ours(config: Qwen3Config, batch: int, length: int, steps: int, chunk: int, micro_batches: int = 1,
             profile: str | None = None, master_weights: str = "") -> dict:
    mesh = make_mesh(1, -1, 1)
    model = create_sharded_model(config, mesh, seed=0)
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-6, warmup_steps=0, master_weights=master_weights))
    rng = np.random.default_rng(0)
    shape = (micro_batches, batch // micro_batches, length)  # [M, rows, T]: M micro-batches accumulated
    ids = rng.integers(0, config.vocab_size, size=shape[:2] + (length + 1,)).astype(np.int32)
    data = {
        "input_ids": ids[..., :-1], "targets": ids[..., 1:],
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy(),
        "segment_ids": np.ones(shape, np.int32),
        "loss_mask": np.ones(shape, np.float32),
        "advantages": rng.normal(size=shape).astype(np.float32),
        "old_logprobs": np.full(shape, -11.0, np.float32),
        "sampler_logprobs": np.full(shape, -11.0, np.float32),
    }
    data = place_batch(data, mesh)  # the placement RLTrainer.update trains with
    loss, temperature = LossConfig(), jnp.float32(1.0)
    t = time.perf_counter()
    jax.block_until_ready(train_step(model, optimizer, data, loss, chunk, temperature))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        metrics = train_step(model, optimizer, data, loss, chunk, temperature)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t) / steps
    if profile:
        with jax.profiler.trace(profile):
            for _ in range(2):
                metrics = train_step(model, optimizer, data, loss, chunk, temperature)
            jax.block_until_ready(metrics)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"step_s": dt, "compile_s": compile_s, "tokens_per_s": batch * length / dt,
            "peak_gib": peak / 2**30 if peak else None}


def compile_only(config: Qwen3Config, batch: int, length: int, chunk: int, micro_batches: int,
                 master_weights: str = "") -> dict:
    """XLA's memory analysis of the same step for abstract arrays: nothing is materialised or run, so
    any backend (CPU included) plans a shape that its memory could not hold."""
    mesh = make_mesh(1, -1, 1)
    optimizer_config = OptimizerConfig(lr=1e-6, warmup_steps=0, master_weights=master_weights)
    model_state, opt_state = abstract_policy_for(config, optimizer_config, mesh, DEFAULT_RULES)
    step = compile_grpo_update(model_state, opt_state, mesh, micro_batches, batch // micro_batches, length,
                               LossConfig(), chunk, jnp.float32(1.0))
    gib = 2 ** 30
    return {"argument_gib": step.argument_bytes / gib, "output_gib": step.output_bytes / gib,
            "aliased_gib": step.alias_bytes / gib, "temp_gib": step.temp_bytes / gib, "peak_gib": step.peak_bytes / gib,
            "compile_s": step.compile_s}


def run_peer_model(config: Qwen3Config, batch: int, length: int, steps: int) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_peer_config(config)).to(dev, dtype=dtype)
    if dev == "cuda":
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    ids = torch.randint(0, config.vocab_size, (batch, length + 1), device=dev)

    def step():
        logits = model(input_ids=ids[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-lp.mean()).backward()
        model.zero_grad(set_to_none=True)

    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
    return {"step_s": dt, "tokens_per_s": batch * length / dt, "peak_gib": peak, "torch": torch.__version__,
            "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="a Qwen3 preset name or 'small' (CPU-sized)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024, help="log-prob chunk length")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches the batch is accumulated over")
    parser.add_argument("--remat", default=None, choices=sorted(REMAT_POLICIES),
                        help="remat policy (default: full on GPU, none on CPU)")
    parser.add_argument("--attention", default=None, choices=("xla", "cudnn"),
                        help="attention implementation (default: cudnn on GPU, xla elsewhere)")
    parser.add_argument("--compute-dtype", default=None, choices=("float32", "bfloat16"),
                        help="activations' dtype (default: bfloat16 on GPU, float32 elsewhere)")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="parameters' (and so AdamW moments') dtype")
    parser.add_argument("--master-weights", default="", choices=("", "float32"),
                        help="float32: an fp32 master copy of bf16 parameters in the optimizer state (its AdamW "
                             "moments fp32 too; optim.master_weights)")
    parser.add_argument("--profile", metavar="DIR", help="write a profiler trace of two steps to DIR")
    parser.add_argument("--compile-only", action="store_true",
                        help="print XLA's memory analysis of the step for abstract arrays (no peer, nothing run)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--only", choices=("ours", "peer"), help="run one side only")
    parser.add_argument("--peer-json", help=argparse.SUPPRESS)  # where `--only peer` writes its figures
    args = parser.parse_args()
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        parser.error(f"--micro-batches must be >= 1 and divide --batch ({args.batch}), got {args.micro_batches}")
    if args.master_weights and args.param_dtype != "bfloat16":
        parser.error(f"--master-weights {args.master_weights} keeps a master copy of bf16 parameters: it needs "
                     f"--param-dtype bfloat16, got {args.param_dtype}")
    params = args.param_dtype + (f"+{args.master_weights}-master" if args.master_weights else "")

    try:
        config = small_preset() if args.preset == "small" else Qwen3Config.preset(args.preset)
    except ValueError as error:
        parser.error(f"--preset: {error}")
    if args.only == "peer":
        peer = run_peer_model(config, args.batch, args.length, args.steps)
        if args.peer_json and peer:
            with open(args.peer_json, "w") as f:
                json.dump(peer, f)
        return
    peer = None
    if not args.no_peer and args.only != "ours" and not args.compile_only:
        peer = run_peer(__file__, [a for a in sys.argv[1:] if a not in ("--no-peer",)])

    on_gpu = jax.default_backend() == "gpu"
    remat = args.remat or ("full" if on_gpu else "none")
    attention = args.attention or ("cudnn" if on_gpu else "xla")
    compute = args.compute_dtype or ("bfloat16" if on_gpu else "float32")
    overrides = dict(remat_policy=remat, dtype=compute, attention_impl=attention, param_dtype=args.param_dtype)
    config = Qwen3Config(**{**config.__dict__, **overrides})
    device_kind = jax.devices()[0].device_kind
    flops = model_flops(config, args.batch * args.length, args.length)
    print(f"device: {device_kind} x{jax.device_count()}  preset: {args.preset} ({config.num_params / 1e6:.1f}M params)  "
          f"B={args.batch} T={args.length} micro-batches={args.micro_batches} remat={remat} attention={attention} "
          f"chunk={args.chunk} params={params} compute={compute}")
    if args.compile_only:
        plan = compile_only(config, args.batch, args.length, args.chunk, args.micro_batches, args.master_weights)
        print(f"compiled memory (GiB): arguments {plan['argument_gib']:.2f} (parameters, AdamW moments, batch), "
              f"outputs {plan['output_gib']:.2f}, aliased {plan['aliased_gib']:.2f}, temporaries {plan['temp_gib']:.2f} "
              f"-> peak {plan['peak_gib']:.2f}  (compile {plan['compile_s']:.1f}s)")
        return
    peak, peak_source = mfu_peak()
    print(f"peak used for MFU: {peak / 1e12:.2f} TFLOP/s ({peak_source})")
    measured = matmul_peak() if on_gpu else None
    if measured:
        print(f"bf16 matmul measured in this run: {measured / 1e12:.1f} TFLOP/s")
    ours = run_ours(config, args.batch, args.length, args.steps, args.chunk, args.micro_batches, args.profile,
                    args.master_weights)
    ours["mfu"] = flops / ours["step_s"] / peak
    mem = f"{ours['peak_gib']:.1f} GiB" if ours["peak_gib"] is not None else "n/a"
    of_measured = f" ({flops / ours['step_s'] / measured:.1%} of the measured matmul)" if measured else ""
    print(f"ours : {ours['tokens_per_s']:,.0f} tokens/s  step {ours['step_s']:.3f}s  MFU {ours['mfu']:.1%}{of_measured}"
          f"  peak mem {mem}  (compile {ours['compile_s']:.1f}s)")
    result = {"device": device_kind, "preset": args.preset, "batch": args.batch, "length": args.length,
              "micro_batches": args.micro_batches, "remat": remat, "attention": attention, "chunk": args.chunk,
              "param_dtype": args.param_dtype, "master_weights": args.master_weights, "compute_dtype": compute,
              "mfu_peak": peak, "measured_matmul": measured, "ours": ours}
    if peer:
        peer["mfu"] = flops / peer["step_s"] / peak
        mem = f"{peer['peak_gib']:.1f} GiB" if peer["peak_gib"] is not None else "n/a"
        print(f"peer : {peer['tokens_per_s']:,.0f} tokens/s  step {peer['step_s']:.3f}s  MFU {peer['mfu']:.1%}  "
              f"peak mem {mem}  (HF PyTorch {peer['torch']}, transformers {peer['transformers']})")
        print(f"ratio ours/peer: {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
        result["peer"] = peer
    if os.environ.get("OUT"):
        name = (f"train_step_{args.preset}_B{args.batch}_T{args.length}_{remat}_m{args.micro_batches}_c{args.chunk}"
                f"_{params}_{attention}.json")
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
