"""benchmarks/train_step_memory.py at its smoke shape: the GRPO update compiled for abstract arrays
per variant, a table row each, the offloading policy's activations counted off the device."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS

pytestmark = pytest.mark.slow  # a subprocess compiling three train steps


def test_train_step_memory_smoke(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "train_step_memory.py"), "--smoke", "--json", str(out)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "XLA:CPU's plan is not XLA:GPU's" in result.stdout
    assert lines[-1].startswith("train_step_memory: 3 of 3 cuDNN-like variants fit 30 GiB on XLA:CPU's plan, "
                                "3 on the GPU (measured, else estimated)"), lines[-1]
    rows = {r["remat"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "save_named", "offload_mlp"}
    for r in rows.values():
        assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0 and r["fits"] and r["gpu_fits"]
        assert r["gpu_est_gib"] is None  # no GPU measurement at this shape to anchor it
        assert r["device_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"] \
            - r["host_bytes"]
    # Saving the named activations holds more than recomputing them; offloading o_proj's output and the
    # MLP's gate and up (4 layers x 2 x 256 x (256 + 2 x 768) bf16) takes them off the device.
    assert rows["save_named"]["temp_bytes"] > rows["full"]["temp_bytes"]
    assert rows["offload_mlp"]["host_bytes"] == 4 * 2 * 256 * (256 + 2 * 768) * 2
    assert rows["full"]["host_bytes"] == rows["save_named"]["host_bytes"] == 0
    assert ("for the GPU (CPU plan fit): --remat offload_mlp --param-dtype float32 --chunk 1024 --attention cudnn"
            in lines)
