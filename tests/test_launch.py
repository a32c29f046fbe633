"""The README's main command, run as users run it (a subprocess), on 8 fake devices."""

import os
import subprocess
import sys


def _launch(*args, cwd):
    env = dict(os.environ)  # conftest set 8 fake CPU devices and the compilation cache
    return subprocess.run([sys.executable, "-m", "rstar_jax.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_default_config_runs_end_to_end(tmp_path):
    result = _launch(f"--config.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 device(s), mesh {'data': 1, 'fsdp': 8, 'tensor': 1}" in result.stdout
    assert "bitwise" in result.stdout and "matches full-forward argmax" in result.stdout
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
    assert (tmp_path / "run" / "hf" / "config.json").exists()


def test_invalid_override_is_rejected_before_work(tmp_path):
    result = _launch("--config.mesh.tensor=0", cwd=tmp_path)
    assert result.returncode == 2
    assert "config.mesh.tensor: must be a positive integer or -1, got 0" in result.stderr
    result = _launch("--config.model.preset=qwen3-99b", cwd=tmp_path)
    assert result.returncode == 2 and "unknown model preset 'qwen3-99b'" in result.stderr
    result = _launch("--config.no_such_field=1", cwd=tmp_path)
    assert result.returncode != 0 and "no_such_field" in result.stderr
