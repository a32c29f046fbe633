"""The composition root: the config's sandbox limits, verifier timeout and mesh reach the objects the
run uses (a real sandbox server on loopback)."""

import asyncio

import pytest

from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file
from rstar_jax.train import builders
from rstar_jax.train.trainer import RLSettings

ALLOCATE = "x = bytearray(192 << 20)\nprint(len(x))"


def _config(**overrides):
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.slow
def test_sandbox_limits_and_the_verifier_timeout_reach_every_tool_call():
    """sandbox.memory_mb bounds each call the rollout loop makes (the loop passes no limit itself);
    sandbox.verify_timeout_s is the scorer's, whichever verifier scores."""

    async def run(config, targets):
        async with builders.rollout_resources(config, targets, urls=["http://127.0.0.1:9"]) as resources:
            result = await resources.client.execute(ALLOCATE)  # as rollout.loop calls it
            return result.status, resources.scorer.timeout_s

    tight = _config(**{"sandbox.memory_mb": 64, "sandbox.verify_timeout_s": 3.5})
    with builders.sandbox(tight) as targets:
        assert asyncio.run(run(tight, targets)) == ("memory_limit", 3.5)
        roomy = _config(**{"sandbox.memory_mb": 512, "sandbox.verify_via": "sandbox", "sandbox.verify_timeout_s": 7.0})
        assert asyncio.run(run(roomy, targets)) == ("ok", 7.0)


def test_the_policy_and_its_settings_follow_the_mesh():
    config = _config(**{"mesh.fsdp": 4, "mesh.data": 2, "rl.micro_batch_tokens": 1000})
    model, mesh = builders.build_policy(config)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1} and builders.data_parallel(mesh) == 8
    assert model.q_proj[...].sharding.mesh == mesh
    one, eight = RLSettings.from_config(config), RLSettings.from_config(config, builders.data_parallel(mesh))
    assert eight.batch.rows == 8 * one.batch.rows  # rl.micro_batch_tokens is per data-parallel shard
    # The micro-batch count is what RoC can keep at most (4 prompts x 4 kept), whatever a step kept.
    assert one.batch.num_micro_batches == 16 and eight.batch.num_micro_batches == 2
    assert one.loop.temperature == config.rollout.temperature and one.roc.group_size == config.rl.group_size
    with pytest.raises(ConfigError, match=r"config\.mesh: data\*fsdp\*tensor = 8 but 16 devices are available"):
        builders.check_mesh(config, 16)
