"""The device's physical limits, measured in the run that quotes them, and the PyTorch peers' plumbing
(their process, their model config).

Imported by the benchmark scripts beside it (`python benchmarks/<script>.py` puts this folder on
the path); also runnable: `python benchmarks/ceilings.py` prints both ceilings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from rstar_jax.model.qwen3 import Qwen3Config
from rstar_jax.train.metrics import peak_flops_for


def _best_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):  # best of: the limit, not the average under other load
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak(dtype=None) -> float:
    """FLOP/s of a square matmul (8192 on a GPU, bf16; 1024 on CPU, fp32)."""
    on_cpu = jax.default_backend() == "cpu"
    n = 1024 if on_cpu else 8192
    dtype = dtype or (jnp.float32 if on_cpu else jnp.bfloat16)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    return 2 * n ** 3 / _best_seconds(jax.jit(lambda x: x @ x), a, repeats=5)


def copy_bandwidth() -> float:
    """Bytes/s read plus written by an elementwise pass over 1 GiB (64 MiB on CPU)."""
    size = (1 << 24) if jax.default_backend() == "cpu" else (1 << 28)
    x = jnp.ones((size,), jnp.float32)
    return 2 * x.nbytes / _best_seconds(jax.jit(lambda v: v * 2), x, repeats=10)


def mfu_peak() -> tuple[float, str]:
    """(FLOP/s, where it comes from) for MFU: the dense bf16 spec the trainer's MFU metric uses
    (989 TFLOP/s on an H100 or H200, as the reference figures), else a matmul measured here."""
    kind = jax.devices()[0].device_kind
    spec = peak_flops_for(kind)
    if spec:
        return spec, f"{kind} dense bf16 spec"
    return matmul_peak(), f"{kind} matmul measured in this run"


def hf_peer_config(config: Qwen3Config):
    """The same model as a `transformers.Qwen3Config` (from `Qwen3Config.to_hf_dict`), SDPA attention."""
    import transformers

    fields = {k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type", "torch_dtype")}
    return transformers.Qwen3Config(**fields, attn_implementation="sdpa")


def run_peer(script: str, args: list[str], timeout: float = 900) -> dict | None:
    """Runs `script --only peer ...` in its own process and returns the JSON it writes (None when the
    peer could not run). Called before this process touches the accelerator: JAX takes most of a
    GPU's memory when it starts, so a peer after it in the same process would measure JAX's leftovers."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        done = subprocess.run([sys.executable, script, *args, "--only", "peer", "--peer-json", out],
                              timeout=timeout, check=False)
        if done.returncode != 0 or not os.path.exists(out):
            print(f"peer: failed (exit {done.returncode}); ours is printed without it", flush=True)
            return None
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    print(f"device: {jax.devices()[0].device_kind}")
    print(f"matmul peak: {matmul_peak() / 1e12:.1f} TFLOP/s")
    print(f"copy bandwidth: {copy_bandwidth() / 1e12:.3f} TB/s")
