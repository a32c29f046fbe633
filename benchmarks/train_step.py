"""Full GRPO train step throughput: tokens/s, MFU and peak memory, beside a PyTorch peer.

    python benchmarks/train_step.py --preset qwen3-1.7b --batch 4 --length 4096   # on a GPU
    python benchmarks/train_step.py --preset small --batch 2 --length 512         # CPU smoke size

Ours: `rstar_jax.train.step.train_step` (policy forward -> chunked log-probs -> GRPO loss -> grads
-> AdamW) with the batch placed as the RL trainer places it (`place_batch`: rows over the mesh's
data-parallel axes) and the optimizer as `make_optimizer` builds it, bf16 compute with fp32 parameters on GPU, `--remat` policy, cuDNN attention on NVIDIA.
Peer (same process, same shapes): Hugging Face `Qwen3ForCausalLM` in PyTorch, forward + backward of
a full-vocabulary log-softmax token loss (what `../shared/bench/hf_qwen3_peer.py torch` measures),
gradient checkpointing on GPU. Pass --no-peer to skip it.

MFU counts model FLOPs only: 6·N·tokens + causal attention 6·L·H·hd·T per token (fwd + bwd, halved
for causality); recomputation is not useful work. The peak is 989 TFLOP/s (H100 dense bf16) on an
H100, otherwise a matmul peak measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model.qwen3 import Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.train.step import OptimizerConfig, make_optimizer, place_batch, train_step

H100_BF16_PEAK = 989e12


def model_flops(config: Qwen3Config, tokens: int, length: int) -> float:
    attention = 6 * config.num_layers * config.num_heads * config.head_dim * length
    return 6 * config.num_params * tokens + attention * tokens


def measured_matmul_peak(dtype) -> float:
    n = 4096 if jax.default_backend() != "cpu" else 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(5):  # best of five: the peak, not the average under other load
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def small_preset() -> Qwen3Config:
    return Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64)


def run_ours(config: Qwen3Config, batch: int, length: int, steps: int, chunk: int) -> dict:
    mesh = make_mesh(1, -1, 1)
    model = create_sharded_model(config, mesh, seed=0)
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-6, warmup_steps=0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, size=(1, batch, length + 1)).astype(np.int32)
    data = {
        "input_ids": ids[..., :-1], "targets": ids[..., 1:],
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (1, batch, length)).copy(),
        "segment_ids": np.ones((1, batch, length), np.int32),
        "loss_mask": np.ones((1, batch, length), np.float32),
        "advantages": rng.normal(size=(1, batch, length)).astype(np.float32),
        "old_logprobs": np.full((1, batch, length), -11.0, np.float32),
        "sampler_logprobs": np.full((1, batch, length), -11.0, np.float32),
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
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"step_s": dt, "compile_s": compile_s, "tokens_per_s": batch * length / dt,
            "peak_gib": peak / 2**30 if peak else None}


def run_peer(config: Qwen3Config, batch: int, length: int, steps: int) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=max(length, 2048), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(dev, dtype=dtype)
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
    del model
    gc.collect()
    return {"step_s": dt, "tokens_per_s": batch * length / dt, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="a Qwen3 preset name or 'small' (CPU-sized)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024, help="log-prob chunk length")
    parser.add_argument("--remat", default=None, help="remat policy (default: full on GPU, none on CPU)")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    remat = args.remat or ("full" if on_gpu else "none")
    overrides = dict(remat_policy=remat, dtype="bfloat16" if on_gpu else "float32",
                     attention_impl="cudnn" if on_gpu else "xla")
    config = small_preset() if args.preset == "small" else Qwen3Config.preset(args.preset)
    config = Qwen3Config(**{**config.__dict__, **overrides})
    device_kind = jax.devices()[0].device_kind
    peak = H100_BF16_PEAK if "H100" in device_kind else measured_matmul_peak(jnp.bfloat16 if on_gpu else jnp.float32)
    flops = model_flops(config, args.batch * args.length, args.length)
    print(f"device: {device_kind} x{jax.device_count()}  preset: {args.preset} ({config.num_params / 1e6:.1f}M params)  "
          f"B={args.batch} T={args.length} remat={remat}")
    print(f"peak used for MFU: {peak / 1e12:.2f} TFLOP/s")
    ours = run_ours(config, args.batch, args.length, args.steps, args.chunk)
    ours["mfu"] = flops / ours["step_s"] / peak
    print(f"ours : {ours['tokens_per_s']:,.0f} tokens/s  step {ours['step_s']:.3f}s  MFU {ours['mfu']:.1%}  "
          f"peak mem {ours['peak_gib'] if ours['peak_gib'] is not None else 'n/a'} GiB  (compile {ours['compile_s']:.1f}s)")
    result = {"device": device_kind, "preset": args.preset, "batch": args.batch, "length": args.length, "ours": ours}
    if not args.no_peer:
        peer = run_peer(config, args.batch, args.length, args.steps)
        if peer:
            peer["mfu"] = flops / peer["step_s"] / peak
            print(f"peer : {peer['tokens_per_s']:,.0f} tokens/s  step {peer['step_s']:.3f}s  MFU {peer['mfu']:.1%}  "
                  f"peak mem {peer['peak_gib'] if peer['peak_gib'] is not None else 'n/a'} GiB  (HF PyTorch)")
            print(f"ratio ours/peer: {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
            result["peer"] = peer
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "train_step_bench.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
