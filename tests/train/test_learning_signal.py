"""RL end to end on an easy task, and the classic breakages that only such a run catches.

A random tiny policy answers with one token, rewarded when that token is an ASCII character (about 2
in 5 of the vocabulary at first). The production trainer (real JaxEngine, RoC, advantages, packed
micro-batches, the jitted update, weight sync) must raise the reward within a few steps; with the
advantage's sign flipped, or the loss mask shifted by one token, the same run must not. Every unit
test of the loss and the masks passes with either breakage; this run fails.
"""

import asyncio

import numpy as np
import pytest
from flax import nnx

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rl.advantages import group_advantages
from rstar_jax.rl.loss import LossConfig
from rstar_jax.rl.registry import register_advantage_estimator
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.train import batching
from rstar_jax.train.rl_batch import BatchConfig, row_length_for
from rstar_jax.train.step import OptimizerConfig, make_optimizer
from rstar_jax.train.trainer import RLSettings, RLTrainer
from rstar_jax.train.weight_sync import EngineSync

pytestmark = pytest.mark.slow  # a dozen RL steps, three times

TOK = ByteTokenizer()
PROMPTS = [(f"Say something ({i}).", "") for i in range(8)]
STEPS = 6


class NoTools:
    async def execute(self, code, stdin="", **kw):
        raise AssertionError("the one-token task makes no tool call")


async def ascii_reward(text, gold, truncated=False):
    return 1.0 if len(text) == 1 and text.isascii() else 0.0


@register_advantage_estimator("test_sign_flipped")
def _sign_flipped_advantages(rewards, groups):
    return -group_advantages(rewards, groups)


def _run(loss: LossConfig = LossConfig()) -> list[float]:
    """Mean reward of each step of a short run from the same random policy."""
    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    engine = JaxEngine(model, slots=64, max_length=256, prefill_buckets=(256,), seed=0)
    settings = RLSettings(
        rollouts_per_prompt=8,
        loop=LoopConfig(max_turns=1, response_budget=1, temperature=1.0, seed=0),
        roc=RocConfig(group_size=4),
        loss=loss,
        batch=BatchConfig(rows=16, row_length=row_length_for(200, 1), num_micro_batches=2,
                          use_sampler_logprobs=False),
        seed=0,
        chunk_size=128,
    )
    optimizer = make_optimizer(model, OptimizerConfig(lr=3e-2, warmup_steps=0))
    trainer = RLTrainer(model, optimizer, TOK, settings, executor=NoTools(), scorer=ascii_reward,
                        weight_sync=EngineSync(engine), generator=engine, template=ChatTemplate.compact())

    async def steps():
        return [(await trainer.astep(PROMPTS, step=step))[0]["rollout/reward_mean"] for step in range(STEPS)]

    try:
        return asyncio.run(steps())
    finally:
        engine.close()


def _gain(rewards: list[float]) -> float:
    return float(np.mean(rewards[-2:]) - np.mean(rewards[:2]))


def test_rl_raises_the_reward_and_the_classic_breakages_do_not(monkeypatch):
    healthy = _run()
    assert _gain(healthy) > 0.3, healthy  # about 0.4 -> 0.9 in six steps

    flipped = _run(LossConfig(advantage_estimator="test_sign_flipped"))  # the advantage's sign flipped
    assert _gain(flipped) < 0.0, flipped

    real_arrays = batching._sequence_arrays

    def shifted(seq):  # the loss mask (and what rides on it) one token off
        arrays = real_arrays(seq)
        for name in ("loss_mask", "advantages", "old_logprobs", "sampler_logprobs"):
            arrays[name] = np.roll(arrays[name], 1)
        return arrays

    with monkeypatch.context() as m:
        m.setattr(batching, "_sequence_arrays", shifted)
        late = _run()
    assert _gain(late) < 0.5 * _gain(healthy) and np.mean(healthy[-2:]) - np.mean(late[-2:]) > 0.3, (healthy, late)
