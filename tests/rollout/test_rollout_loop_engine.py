"""The rollout loop on the real in-process JaxEngine (tiny random Qwen3, byte tokenizer).

The first turn is scripted (a random model does not write tool calls); the second is sampled by the
engine after the real observation ids. A full forward over prompt + response must reproduce every
engine log-prob at its position: the context the engine saw is exactly the recorded token sequence
(nothing re-tokenized, nothing shifted).
"""

import asyncio
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.rollout.loop import LoopConfig, run_trajectory
from rstar_jax.rollout.protocol import GenerateResult
from rstar_jax.rollout.tool_env import ToolEnv
from tests.rollout.test_rollout_loop import FakeExecutor, call, exact_scorer

TOK = ByteTokenizer()
SCRIPTED_VERSION = -7


class ScriptedFirstTurn:
    """Scripts the first assistant turn, then delegates every later turn to the engine."""

    name = "scripted+jax"

    def __init__(self, engine, first_turn: str):
        self.engine, self.first_ids = engine, TOK.encode(first_turn)

    async def generate(self, input_ids, sampling, rid=None):
        if TOK.decode(input_ids).count("<|im_start|>assistant") == 1:
            return GenerateResult(list(self.first_ids), [0.0] * len(self.first_ids), "stop", SCRIPTED_VERSION)
        return await self.engine.generate(input_ids, sampling, rid)

    async def capacity(self):
        return await self.engine.capacity()

    async def abort(self, rid):
        await self.engine.abort(rid)

    @property
    def version(self):
        return self.engine.version


def test_engine_log_probs_align_with_the_recorded_sequence():
    config = dataclasses.replace(Qwen3Config.tiny(), max_position_embeddings=4096)
    assert config.vocab_size == TOK.vocab_size
    model = Qwen3(config, rngs=nnx.Rngs(0))
    engine = JaxEngine(model, slots=4, max_length=2304, prefill_buckets=(2304,))
    first = f"Let me run it. {call('print(2 + 2)')}{IM_END}"
    try:
        generator = ScriptedFirstTurn(engine, first)
        cfg = LoopConfig(max_turns=4, response_budget=len(TOK.encode(first)) + 200, tool_env=ToolEnv.preset_defaults("rich", observation_max_chars=64))

        async def main():
            return await asyncio.gather(*[
                run_trajectory(generator, TOK, FakeExecutor(), "What is 2+2?", "4", config=cfg, scorer=exact_scorer,
                               sample_index=i) for i in range(4)])

        trajectories = asyncio.run(main())
    finally:
        engine.close()
    for t in trajectories:
        t.check()
        assert t.n_turns >= 2 and t.n_tool_calls >= 1 and len(t.response_ids) <= cfg.response_budget
        sequence = np.asarray(t.prompt_ids + t.response_ids)
        logits = model(jnp.asarray(sequence[None, :-1]))[0]
        full = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        engine_positions = [k for k, v in enumerate(t.policy_versions) if v == 0]
        assert engine_positions and all(t.loss_mask[k] == 1 for k in engine_positions)
        p = len(t.prompt_ids)
        expected = [full[p + k - 1, t.response_ids[k]] for k in engine_positions]
        got = [t.sampler_logprobs[k] for k in engine_positions]
        np.testing.assert_allclose(got, expected, atol=2e-4)
        # Sampled (scripted or engine) tokens carry loss mask 1, observation tokens 0.
        assert [m for m in t.loss_mask] == [int(v != -1) for v in t.policy_versions]
        assert t.response_ids[:len(TOK.encode(first))] == TOK.encode(first)


def test_a_turn_interrupted_by_an_in_place_push_continues_and_is_scored():
    """Asynchronous RL's weight push mid-turn: the engine swaps between two decode steps, the turn
    goes on under the new weights, the trajectory ends as it would have and is scored, and its
    sampled tokens carry the version that produced each (old, then new)."""
    config = dataclasses.replace(Qwen3Config.tiny(), max_position_embeddings=4096)
    model = Qwen3(config, rngs=nnx.Rngs(0))
    engine = JaxEngine(model, slots=2, max_length=2304, prefill_buckets=(2304,))
    first = f"Let me run it. {call('print(2 + 2)')}{IM_END}"
    swapped = []

    def push_mid_turn():
        for _ in range(20_000):
            with engine._lock:  # between two engine steps
                running = [r for r in engine._active if r is not None]
                if running and len(running[0].tokens) >= 8:
                    swapped.append(engine.update_weights(Qwen3(config, rngs=nnx.Rngs(1)), in_place=True, version=1))
                    return
            time.sleep(0.001)

    try:
        cfg = LoopConfig(max_turns=4, response_budget=len(TOK.encode(first)) + 200,
                         tool_env=ToolEnv.preset_defaults("rich", observation_max_chars=64))

        async def main():
            pusher = asyncio.create_task(asyncio.to_thread(push_mid_turn))
            trajectory = await run_trajectory(ScriptedFirstTurn(engine, first), TOK, FakeExecutor(), "What is 2+2?",
                                              "4", config=cfg, scorer=exact_scorer)
            await pusher
            return trajectory

        t = asyncio.run(main())
    finally:
        engine.close()
    assert swapped == [1]
    t.check()
    sampled = [v for v, m in zip(t.policy_versions, t.loss_mask) if m and v != SCRIPTED_VERSION]
    assert sampled[:8] == [0] * 8 and sampled[-1] == 1 and sampled == sorted(sampled)
    assert t.finish_reason and t.finish_reason != "aborted" and t.n_abort_resumes == 0
    assert t.reward in (0.0, 1.0) and t.n_tool_calls >= 1
