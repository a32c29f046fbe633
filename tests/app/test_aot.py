"""Ahead-of-time compile of the production steps on an abstract mesh (`python -m rstar_jax.aot`)."""

import subprocess
import sys

import jax
import pytest

from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.config import resolve
from rstar_jax.parallel import make_mesh
from rstar_jax.app.aot import abstract_policy, compile_steps, prefill_length
from rstar_jax.parallel.memory import memory_plan
from rstar_jax.app import builders


def test_compiled_update_holds_the_planned_parameters_and_optimizer_state_per_device():
    """The compiled GRPO update's per-device arguments are the memory plan's parameters and AdamW
    moments (plus the step counters) and the batch's rows; donation aliases the state."""
    config = load_config_file(str(REPO_CONFIGS / "stage1.py"))
    config.model.preset = "tiny"
    config.data.num_prompts_per_step = 4
    mesh = make_mesh(*builders.check_mesh(config, jax.device_count()))
    assert mesh.shape["fsdp"] == 8
    update, sft = compile_steps(config, mesh)
    plan = memory_plan(resolve.model_config(config), mesh, rules=builders.mesh_rules(config))
    counters = sum(x.dtype.itemsize for x in jax.tree.leaves(abstract_policy(config, mesh)[1][1]) if x.ndim == 0)
    for step in (update, sft):
        assert step.argument_bytes - step.data_bytes == plan.param_bytes + plan.opt_state_bytes + counters, step
        assert step.alias_bytes == plan.param_bytes + plan.opt_state_bytes + counters  # donated in place
    # RoC keeps at most 4 x 16 trajectories of up to 8K + 2K tokens, one 10240-token row each per
    # micro-batch and device: 8 micro-batches x 1 row per device x 8 arrays of 4 bytes.
    assert update.data_bytes == 8 * 1 * 10240 * 8 * 4


def test_the_engine_prefill_planned_is_one_chunk_with_chunked_prefill():
    config = load_config_file(str(REPO_CONFIGS / "stage1.py"))
    e = config.rollout.engine  # 10240-token contexts
    e.chunked_prefill_size = 8192
    assert prefill_length(e) == 8192
    e.chunked_prefill_size = 3000  # the prompt bucket that holds a chunk
    assert prefill_length(e) == 4096
    e.chunked_prefill_size = 0
    assert prefill_length(e) == e.max_length == 10240


@pytest.mark.slow
def test_the_command_prints_the_memory_analysis_beside_the_plan():
    result = subprocess.run([sys.executable, "-m", "rstar_jax.aot", "--config=configs/tiny.py", "--devices=4",
                             "--config.mesh.fsdp=4", "--generation_tp=2"], capture_output=True, text=True, timeout=600,
                            cwd=REPO_CONFIGS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh data=1 x fsdp=4 x tensor=1 (4 devices)" in result.stdout
    for row in ("grpo update", "sft step", "engine prefill (tp 2)", "engine decode (tp 2)", "memory plan per device"):
        assert row in result.stdout
