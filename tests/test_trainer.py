"""The RL step composed end to end in process: real JaxEngine, real loop, RoC, update, weight sync.

The tool executor and scorer are test doubles here (the sandbox-backed run is the launcher's
end-to-end test); the rewards alternate within each group so RoC keeps mixed groups.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.rl.loss import LossConfig
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.engine import JaxEngine
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.train.rl_batch import BatchConfig, row_length_for
from rstar_jax.train.step import OptimizerConfig, make_optimizer
from rstar_jax.train.trainer import RLSettings, RLTrainer

TOK = ByteTokenizer()


@dataclasses.dataclass
class _Result:
    status: str = "ok"
    stdout: str = "1\n"
    stderr: str = ""
    duration_s: float = 0.0


class NoTools:
    async def execute(self, code, stdin="", **kw):
        return _Result()


def _trainer(scorer):
    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    engine = JaxEngine(model, slots=4, max_length=2048, prefill_buckets=(2048,), seed=0)
    budget = 16
    settings = RLSettings(
        rollouts_per_prompt=4,
        loop=LoopConfig(max_turns=2, response_budget=budget, temperature=1.0),
        roc=RocConfig(group_size=2, variant="paper"),
        loss=LossConfig(),
        batch=BatchConfig(rows=2, row_length=row_length_for(1900, budget), packed=False),
        chunk_size=512,
    )
    opt = make_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0))
    return RLTrainer(model, opt, TOK, settings, executor=NoTools(), scorer=scorer, engine=engine), engine


def test_step_updates_the_policy_and_syncs_the_engine():
    calls = {"n": 0}

    async def alternating(text, gold, truncated=False):
        calls["n"] += 1
        return float(calls["n"] % 2)

    trainer, engine = _trainer(alternating)
    try:
        before = np.asarray(trainer.model.q_proj[...]).copy()
        metrics, trajectories = trainer.step([("What is 1+1?", "2"), ("What is 2+2?", "4")])
        assert len(trajectories) == 8 and {t.group_id for t in trajectories} == {0, 1}
        for t in trajectories:
            t.check()
            assert len(t.response_ids) <= 16 and sum(t.loss_mask) >= 1
        assert metrics["update/skipped"] == 0 and metrics["roc/rollouts_kept"] == 4
        assert np.isfinite(metrics["update/loss"]) and metrics["update/grad_norm"] > 0
        assert not np.array_equal(before, np.asarray(trainer.model.q_proj[...]))
        assert engine.version == 1  # the engine now samples from the updated policy
        # Sampler log-probs (engine, temperature 1) match the trainer's recomputation before the update.
        assert metrics["drift/logprob_abs_max"] < 1e-3
        assert metrics["rollout/retractions"] == 0  # a pool of slots x context never overflows
    finally:
        engine.close()


def test_step_without_signal_is_skipped():
    async def always_wrong(text, gold, truncated=False):
        return 0.0

    trainer, engine = _trainer(always_wrong)
    try:
        metrics, _ = trainer.step([("What is 1+1?", "2")])
        assert metrics["update/skipped"] == 1 and metrics["roc/dropped_all_wrong"] == 1
        assert engine.version == 0
    finally:
        engine.close()
