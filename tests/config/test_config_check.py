"""Checking a config is cheap: `python -m rstar_jax.config` loads and validates every shipped file
without importing JAX (nor the engine, the SGLang client or the sandbox client).

Each file goes through the command's own code path (`runpy` of `rstar_jax.config`, as `python -m`
runs it) in a fresh interpreter, which then reports which of the heavy packages it ended up importing.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
HEAVY = ("jax", "flax", "optax", "grpc", "aiohttp", "rstar_jax.engine.jax_engine", "rstar_jax.rollout.sglang",
         "sandbox_service.client")

PROBE = """
import runpy, sys
sys.argv = ["rstar_jax.config", "--config=" + sys.argv[1]]
try:
    runpy.run_module("rstar_jax.config", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted(h for h in {heavy!r} if any(m == h or m.startswith(h + ".") for m in sys.modules))
print("EXIT", code or 0, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""


def test_every_shipped_config_is_a_file_the_probe_sees():
    assert {"base.py", "tiny.py", "stage1.py", "stage2.py", "stage3.py", "sft.py", "eval.py"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_checking_a_config_imports_no_jax(name):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), f"configs/{name}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("EXIT 0 "), proc.stderr[-2000:]
    assert last.endswith("HEAVY -"), f"checking configs/{name} imported {last.split('HEAVY ')[1]}"
    assert proc.stdout.lstrip().startswith("{"), proc.stdout[:200]  # the config, printed as JSON
