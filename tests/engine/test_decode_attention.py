"""benchmarks/decode_attention.py as the GPU suite runs it (`--smoke` here, on CPU): the engine's
XLA decode attention over gathered pages and the Pallas GPU paged-attention kernel (in interpret
mode) agree on rows that end mid-page, for every kernel setting it tries."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS

pytestmark = pytest.mark.slow  # a subprocess


def test_the_xla_path_and_the_pallas_kernel_agree(tmp_path):
    out = tmp_path / "attention.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "decode_attention.py"), "--smoke", "--dtype", "float32",
                             "--json", str(out)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]  # the script asserts the agreement
    figures = json.loads(out.read_text())
    assert [(f["k_splits"], f["pages_per_compute_block"]) for f in figures["pallas"]] == [(8, 4), (8, 8), (16, 4), (16, 8)]
    assert figures["xla_s"] > 0 and result.stdout.splitlines()[-1].startswith("pallas_vs_xla=")
