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


def test_rl_mode_runs_two_steps_with_the_real_sandbox_and_engine(tmp_path):
    """`--config.mode=rl` on the tiny config: a local sandbox server, the JaxEngine, two GRPO-RoC steps,
    metrics and checkpoints (the SFT warm-up is left out to keep CI short)."""
    import json

    run = tmp_path / "rl"
    result = _launch("--config.mode=rl", f"--config.run_dir={run}", "--config.sft.before_rl=False",
                     "--config.train.steps=2", "--config.rollout.response_budget=32",
                     "--config.checkpoint.every_steps=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rl] done" in result.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "rollout/reward_mean" in r and "roc/groups_total" in r and r["roc/groups_total"] == 2
        assert r["rollout/response_length_mean"] <= 32
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
