"""Compiled memory of the GRPO train step's variants, planned on CPU before a GPU lease measures them.

    python benchmarks/train_step_memory.py            # Qwen3-1.7B, 4 x 4096, one device (the GPU suite's shape)
    python benchmarks/train_step_memory.py --smoke    # a tiny shape, to check the script itself
    python benchmarks/train_step_memory.py --only "full bfloat16"   # the variants whose name holds the text

Each variant is the production update (`rstar_jax.train.step._train_step`: micro-batch scan, chunked
log-prob head, GRPO loss, AdamW) lowered for abstract arrays and compiled (`rstar_jax.app.aot.
compile_grpo_update`, XLA's `memory_analysis`): nothing is allocated, so the 1.7B model at 4096
tokens per row compiles here in about 10 s a variant. Variants: remat policy x parameter dtype (and
with it the AdamW moments') x log-prob chunk, with bf16 compute; and bf16 parameters with an fp32
master copy in the optimizer state (`optim.master_weights`; its AdamW moments fp32). A variant "fits" when arguments +
outputs - donated + temporaries <= --budget-gib (30).

What differs from the GPU: XLA:CPU's fusions and buffer assignment are not XLA:GPU's, and cuDNN's
attention does not compile here. Its stand-in is attention_impl="blockwise" (the same residuals as
the fused kernel: q, k, v, the output and row statistics; plus [B, heads, 256, T] fp32 score blocks
as temporaries), so the table ranks the variants and says which can fit; the GPU suite's
`--train-variants` measures the ones that fit. One row with XLA attention shows what the [T, T]
scores cost instead. Remat policies: `rstar_jax.model.config.REMAT_POLICY_NAMES`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp

from rstar_jax.app.aot import abstract_policy_for, compile_grpo_update
from rstar_jax.model.qwen3 import REMAT_OFFLOADED, Qwen3Config
from rstar_jax.model.sharding import DEFAULT_RULES
from rstar_jax.parallel import make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.train.step import OptimizerConfig

GIB = 2 ** 30
REMATS = ("none", "full", "dots_no_batch", "save_attention", "save_qkv_attention", "save_named", "offload_mlp",
          "offload_named")
# Peaks the GPU suite measured on an H100 / H200 (benchmarks/RESULTS.md, 2026-11-26/27; cuDNN attention,
# chunk 1024), printed beside the plan where a variant was measured.
CPU_SAVED_FACTOR = 0.5  # GPU bytes per XLA:CPU byte of saved activations (estimate_gpu)
GPU_MEASURED_GIB = {("full", "float32", 1024, "cudnn"): 29.6, ("dots_no_batch", "float32", 1024, "cudnn"): 44.3,
                    ("full", "bfloat16", 1024, "cudnn"): 17.9, ("dots_no_batch", "bfloat16", 1024, "cudnn"): 33.7,
                    ("full", "float32", 2048, "cudnn"): 32.2, ("full", "float32", 512, "cudnn"): 31.6}


def variants(smoke: bool) -> list[dict]:
    """remat x parameter dtype at chunk 1024 (no remat once: it is far over either way); the chunk where
    the head's share matters (remat full, whose activations are smallest); XLA attention once."""
    out = [dict(remat=r, param_dtype=p, chunk=1024, attention="blockwise")
           for p in ("float32", "bfloat16") for r in REMATS if (r, p) != ("none", "bfloat16")]
    out.append(dict(remat="full", param_dtype="bfloat16", master="float32", chunk=1024, attention="blockwise"))
    out += [dict(remat="full", param_dtype="float32", chunk=c, attention="blockwise") for c in (512, 2048)]
    out.append(dict(remat="full", param_dtype="float32", chunk=1024, attention="xla"))
    out = [{"master": "", **v} for v in out]
    if smoke:
        out = [v for v in out if v["remat"] in ("full", "save_named", "offload_mlp") and v["param_dtype"] == "float32"
               and v["attention"] == "blockwise" and v["chunk"] == 1024]
    return out


def offloaded_bytes(config: Qwen3Config, remat: str, rows: int, length: int) -> int:
    """Bytes of the activations `remat` moves to pinned host memory, from their shapes (bf16): XLA:CPU
    keeps them in its one memory and counts them as device temporaries, where a GPU would not."""
    c = config
    widths = {"query_proj": c.num_heads * c.head_dim, "key_proj": c.num_kv_heads * c.head_dim,
              "value_proj": c.num_kv_heads * c.head_dim, "attention_out": c.num_heads * c.head_dim,
              "out_proj": c.hidden_size, "mlp_gate": c.intermediate_size, "mlp_up": c.intermediate_size}
    width = sum(widths[name] for name in REMAT_OFFLOADED.get(remat, ()))
    return c.num_layers * rows * length * width * jnp.dtype(jnp.bfloat16).itemsize


def train_step_args(v: dict) -> str:
    """The variant as `benchmarks/train_step.py` arguments (what the GPU suite runs)."""
    attention = "cudnn" if v["attention"] == "blockwise" else v["attention"]
    master = f" --master-weights {v['master']}" if v.get("master") else ""
    return f"--remat {v['remat']} --param-dtype {v['param_dtype']}{master} --chunk {v['chunk']} --attention {attention}"


def compile_variant(base: Qwen3Config, v: dict, batch: int, length: int) -> dict:
    config = Qwen3Config(**{**base.__dict__, "remat_policy": v["remat"], "param_dtype": v["param_dtype"],
                            "dtype": "bfloat16", "attention_impl": v["attention"]})
    mesh = make_mesh(1, -1, 1, devices=jax.devices()[:1])
    optimizer_config = OptimizerConfig(lr=1e-6, warmup_steps=0, master_weights=v.get("master", ""))
    model_state, opt_state = abstract_policy_for(config, optimizer_config, mesh, DEFAULT_RULES)
    step = compile_grpo_update(model_state, opt_state, mesh, 1, batch, length, LossConfig(), v["chunk"],
                               jnp.float32(1.0))
    host, device = step.host_temp_bytes, step.peak_bytes
    if not host and v["remat"] in REMAT_OFFLOADED:  # XLA:CPU reported none: the offloaded shapes' bytes
        host = offloaded_bytes(config, v["remat"], batch, length)
        device -= host
    return {**v, "argument_bytes": step.argument_bytes, "output_bytes": step.output_bytes,
            "alias_bytes": step.alias_bytes, "temp_bytes": step.temp_bytes, "host_bytes": host,
            "device_bytes": device, "compile_s": step.compile_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--batch", type=int, default=4, help="rows (one micro-batch)")
    parser.add_argument("--length", type=int, default=4096, help="tokens per row")
    parser.add_argument("--budget-gib", type=float, default=30.0)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 x 256, three variants")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", metavar="TEXT", help="only the variants whose name (the table's first column) "
                                                        "contains TEXT")
    args = parser.parse_args()
    if args.smoke:
        base = Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=64)
        args.preset, args.batch, args.length = "smoke", 2, 256
    else:
        try:
            base = Qwen3Config.preset(args.preset)
        except ValueError as error:
            parser.error(f"--preset: {error}")
    print(f"train step compiled memory: {args.preset} ({base.num_params / 1e9:.2f}B parameters), "
          f"{args.batch} x {args.length} tokens, one micro-batch, AdamW, bf16 compute, one device; "
          f"jax {jax.__version__} {jax.default_backend()} ({platform.machine()}), budget {args.budget_gib:g} GiB")
    rows = []
    t0 = time.perf_counter()
    chosen = [v for v in variants(args.smoke) if args.only is None or args.only in variant_name(v)]
    if not chosen:
        parser.error(f"--only {args.only!r}: no variant's name contains it; names: "
                     + ", ".join(variant_name(v) for v in variants(args.smoke)))
    for v in chosen:
        try:
            row = compile_variant(base, v, args.batch, args.length)
        except Exception as error:  # one variant that does not compile leaves the rest of the table
            row = {**v, "error": f"{type(error).__name__}: {error}"}
        key = (v["remat"], v["param_dtype"], v["chunk"], "cudnn" if v["attention"] == "blockwise" else v["attention"])
        measured = None if args.smoke or v.get("master") else GPU_MEASURED_GIB.get(key)
        rows.append({**row, "gpu_measured_gib": measured})
        print(f"compiled {variant_name(v)}: " + (row["error"].splitlines()[0][:160] if "error" in row else
              f"{row['compile_s']:.0f} s"), file=sys.stderr, flush=True)
    estimate_gpu(rows)
    for row in rows:
        if "error" not in row:
            row["fits"] = row["device_bytes"] <= args.budget_gib * GIB
            # What the GPU measured decides where it measured; else the estimate; else the CPU plan.
            gpu = row["gpu_measured_gib"] if row["gpu_measured_gib"] is not None else row["gpu_est_gib"]
            row["gpu_fits"] = row["fits"] if gpu is None else gpu <= args.budget_gib
    print(table(rows, args.budget_gib))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "batch": args.batch, "length": args.length, "jax": jax.__version__,
                       "backend": jax.default_backend(), "budget_gib": args.budget_gib, "rows": rows}, f, indent=2)
    cudnn_like = [r for r in rows if r["attention"] == "blockwise" and "error" not in r]
    for r in cudnn_like:
        if r["gpu_fits"]:
            how = ("measured" if r["gpu_measured_gib"] is not None else
                   "estimated" if r["gpu_est_gib"] is not None else "CPU plan")
            print(f"for the GPU ({how} fit): {train_step_args(r)}")
    failed = [r for r in rows if "error" in r]
    print(f"train_step_memory: {sum(r['fits'] for r in cudnn_like)} of {len(cudnn_like)} cuDNN-like variants fit "
          f"{args.budget_gib:g} GiB on XLA:CPU's plan, {sum(r['gpu_fits'] for r in cudnn_like)} on the GPU "
          f"(measured, else estimated)"
          + (f"; {len(failed)} failed to compile" if failed else "") + f"; {time.perf_counter() - t0:.0f} s")
    if failed:
        raise SystemExit(1)


def variant_name(v: dict) -> str:
    master = f"+{v['master']} master" if v.get("master") else ""
    return (f"{v['remat']} {v['param_dtype']}{master} chunk {v['chunk']}"
            + (" xla-attn" if v["attention"] == "xla" else ""))


def estimate_gpu(rows: list[dict]) -> None:
    """Sets each row's "gpu_est_gib": the GPU's measured peak of remat full at the same parameter dtype
    and chunk 1024, plus half of the CPU temporaries above that variant's, less the offloaded bytes.
    Half, because XLA:CPU's compiled program holds the scan's stacked saved activations in f32 where the
    lowered program has them in bf16 (save_named over full: 35.5 GiB for 17.5 GiB of bf16 activations at
    the suite's shape); checked against the variants the GPU measured (`validation` below the table).
    None where no anchor was measured (and for XLA attention)."""
    anchors = {r["param_dtype"]: r for r in rows if "error" not in r and r["gpu_measured_gib"] is not None
               and (r["remat"], r["chunk"], r["attention"]) == ("full", 1024, "blockwise") and not r.get("master")}

    def state(r: dict) -> int:  # parameters and optimizer state (with a master: its copy, fp32 moments)
        return r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"]

    for r in rows:
        a = anchors.get(r.get("param_dtype"))
        if "error" in r or a is None or r["attention"] != "blockwise":
            r["gpu_est_gib"] = None
            continue
        r["gpu_est_gib"] = (a["gpu_measured_gib"] + (state(r) - state(a)) / GIB
                            + CPU_SAVED_FACTOR * (r["temp_bytes"] - a["temp_bytes"]) / GIB - r["host_bytes"] / GIB)


def table(rows: list[dict], budget: float) -> str:
    lines = [f"{'variant':<46}{'args GiB':>9}{'out GiB':>9}{'donated':>9}{'temp GiB':>9}{'host GiB':>9}"
             f"{'total GiB':>10}{'fits':>6}{'GPU est.':>9}{'GPU meas.':>10}{'fits':>6}{'compile s':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{variant_name(r):<46}failed: {r['error'].splitlines()[0][:120]}")
            continue
        est, meas = r["gpu_est_gib"], r["gpu_measured_gib"]
        lines.append(f"{variant_name(r):<46}{r['argument_bytes'] / GIB:>9.2f}{r['output_bytes'] / GIB:>9.2f}"
                     f"{r['alias_bytes'] / GIB:>9.2f}{r['temp_bytes'] / GIB:>9.2f}{r['host_bytes'] / GIB:>9.2f}"
                     f"{r['device_bytes'] / GIB:>10.2f}{'yes' if r['fits'] else 'no':>6}"
                     f"{(f'{est:.1f}' if est is not None else '-'):>9}"
                     f"{(f'{meas:.1f}' if meas is not None else '-'):>10}"
                     f"{('yes' if r['gpu_fits'] else 'no') if est is not None or meas is not None else '-':>6}"
                     f"{r['compile_s']:>10.1f}")
    lines.append(f"total = args + out - donated + temp - host: device memory on XLA:CPU's plan; fits: <= {budget:g} "
                 "GiB (the first on the CPU plan, the second on the GPU: measured, else estimated). host: "
                 "activations offloaded to pinned host memory (XLA:CPU has one memory and counts them among its "
                 "temporaries: their bf16 bytes are taken out).")
    lines.append("XLA:CPU's plan is not XLA:GPU's (other fusions and buffer assignment; at the suite's shape remat "
                 "full measured 29.6 GiB on the GPU against 36.5 here), and cuDNN's attention does not compile here: "
                 "'blockwise' attention stands in for it (the same residuals, plus [B, heads, 256, T] fp32 score "
                 "blocks).")
    lines.append(f"GPU est.: the GPU's measured peak of remat full (same parameter dtype, chunk 1024) + the "
                 f"state above its (a master copy and fp32 moments) + {CPU_SAVED_FACTOR:g} x the CPU temporaries "
                 f"above its, - host. GPU meas.: the peak the GPU suite "
                 "measured with cuDNN (benchmarks/RESULTS.md, H100/H200).")
    checked = [r for r in rows if "error" not in r and r["gpu_est_gib"] is not None
               and r["gpu_measured_gib"] is not None
               and (r["remat"], r["chunk"]) != ("full", 1024)]
    if checked:
        lines.append("validation (estimate / measured, GiB): " + "; ".join(
            f"{variant_name(r)} {r['gpu_est_gib']:.1f} / {r['gpu_measured_gib']:.1f}" for r in checked))
    return "\n".join(lines)

if __name__ == "__main__":
    main()
