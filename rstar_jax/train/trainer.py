"""The GRPO-RoC RL loop (rStar2-Agent §1.2), composed from the project's pieces.

Per step: prompts -> 2G trajectories each (async, multi-turn, tools in the sandbox) -> rewards ->
RoC (drop all-equal groups, keep G) -> advantages over kept rollouts -> fixed-shape micro-batches
-> one jitted, sharded, donated update -> weight sync to the generator -> metrics -> checkpoint.
A step in which every group was dropped makes no update (the spec's skipped step) but still
advances the data stream and is logged.

The trainer receives its tool executor and scorer from the caller (the launcher wires the sandbox
client and the verifier), so the loop itself never runs untrusted code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.rl.loss import LossConfig, finalize_metrics
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.engine import JaxEngine
from rstar_jax.rollout.loop import LoopConfig, run_trajectory
from rstar_jax.rollout.orchestrator import Orchestrator
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.metrics import flops_per_token, peak_flops_for, throughput
from rstar_jax.train.rl_batch import BatchConfig, prepare_batch
from rstar_jax.train.step import compute_logprobs, train_step


@dataclasses.dataclass(frozen=True)
class RLSettings:
    rollouts_per_prompt: int  # 2G
    loop: LoopConfig
    roc: RocConfig
    loss: LossConfig
    batch: BatchConfig
    chunk_size: int = 1024
    max_concurrency: int = 64


class RLTrainer:
    """Runs GRPO-RoC steps with the in-process JaxEngine (or any Generator / Scheduler)."""

    def __init__(self, model, optimizer, tokenizer: Tokenizer, settings: RLSettings, *, executor, scorer,
                 engine: JaxEngine | None = None, scheduler=None, template: ChatTemplate | None = None,
                 sync_weights: Callable[[Any], None] | None = None):
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.settings = settings
        self.executor = executor
        self.scorer = scorer
        self.engine = engine
        self.scheduler = scheduler
        self.template = template or ChatTemplate(tool_name=settings.loop.tool_name)
        # The version generators report for the current weights: the 1-based step of the last update
        # when steps are numbered (stable across resumes), else a count of updates.
        self.weights_version = 0
        # Default weight sync: the in-process engine swaps parameters in place.
        self.sync_weights = sync_weights or (
            lambda m: engine.update_weights(m, version=self.weights_version) if engine is not None else None)
        self._next_group = 0

    async def rollout(self, prompts: list[tuple[str, str]], *, first_group_id: int | None = None) -> list[Trajectory]:
        """2G trajectories per prompt. Group ids continue from the previous call unless given (a
        resumed run passes step * prompts_per_step, so seeded sampling repeats the same draws)."""
        s = self.settings
        if first_group_id is not None:
            self._next_group = first_group_id

        async def one(question, gold, group_id, index):
            return await run_trajectory(self.engine, self.tokenizer, self.executor, question, gold, config=s.loop,
                                        scorer=self.scorer, template=self.template, scheduler=self.scheduler,
                                        group_id=group_id, sample_index=index)

        orchestrator = Orchestrator(one, max_concurrency=s.max_concurrency)
        trajectories = await orchestrator.collect(prompts, s.rollouts_per_prompt, first_group_id=self._next_group)
        self._next_group += len(prompts)
        return trajectories

    def update(self, trajectories: list[Trajectory], *, step: int | None = None, sync: bool = True) -> dict:
        """RoC, advantages, the jitted update and the weight sync; returns this step's metrics.

        step: RoC's random choice is seeded with (roc.seed, step), so each step draws afresh and a
        resumed run draws exactly as the uninterrupted one did."""
        s = self.settings
        t0 = time.perf_counter()
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        roc = s.roc
        if step is not None:
            roc = dataclasses.replace(roc, seed=int(np.random.SeedSequence([roc.seed, step]).generate_state(1)[0]))
        prepared = prepare_batch(trajectories, roc, s.batch, decode=decode)
        metrics: dict[str, Any] = dict(prepared.roc.stats())
        if prepared.skipped:
            metrics["update/skipped"] = 1
            return metrics
        batch = {k: jnp.asarray(v) for k, v in prepared.batch.items()}
        if not s.batch.use_sampler_logprobs:
            # π_old recomputed by the trainer (as verl does); sampler log-probs stay for the drift metric.
            old, _ = compute_logprobs(self.model, batch, chunk_size=s.chunk_size)
            batch["old_logprobs"] = jnp.where(batch["loss_mask"] > 0, old, 0.0)
        out = train_step(self.model, self.optimizer, batch, s.loss, s.chunk_size, jnp.float32(1.0))
        out = jax.device_get(out)
        update_s = time.perf_counter() - t0
        tokens = int(np.count_nonzero(prepared.batch["segment_ids"]))
        # Training FLOPs of the real (unpadded) tokens at the mean packed sequence length; the
        # π_old recomputation adds a forward (a third) when the trainer recomputes it.
        mean_length = max(1, tokens // max(1, len(prepared.roc.kept_indices)))
        flops = flops_per_token(self.model.config, mean_length).flops_per_token
        if not s.batch.use_sampler_logprobs:
            flops *= 4.0 / 3.0
        devices = jax.devices()
        metrics.update({f"update/{k}": v for k, v in throughput(
            tokens, update_s, flops, num_devices=len(devices),
            peak_flops_per_device=peak_flops_for(devices[0].device_kind)).items()})
        metrics["update/tokens"] = tokens
        metrics.update(finalize_metrics(out))
        metrics["update/loss"] = float(out["loss"])
        metrics["update/grad_norm"] = float(out["grad_norm"])
        metrics["update/skipped"] = 0
        metrics["time/update_s"] = time.perf_counter() - t0
        if sync:
            t1 = time.perf_counter()
            if inspect.isawaitable(result := self._sync(step=None)):
                result.close()
                raise TypeError("RLTrainer.update: sync_weights is async; use astep (or update(sync=False))")
            metrics["time/weight_sync_s"] = time.perf_counter() - t1
        return metrics

    def _sync(self, *, step: int | None):
        """Bumps the weights version and starts the sync; returns what sync_weights returned."""
        self.weights_version = step + 1 if step is not None else self.weights_version + 1
        return self.sync_weights(self.model)

    def step(self, prompts: list[tuple[str, str]], *, step: int | None = None) -> tuple[dict, list[Trajectory]]:
        return asyncio.run(self.astep(prompts, step=step))

    async def astep(self, prompts: list[tuple[str, str]], *, step: int | None = None) -> tuple[dict, list[Trajectory]]:
        """One RL step inside a running event loop (clients bound to the loop stay usable).

        step (0-based): when given, group ids and RoC's draw derive from it, which makes a step
        reproducible from its number alone (exact resume)."""
        t0 = time.perf_counter()
        first_group = None if step is None else step * len(prompts)
        trajectories = await self.rollout(prompts, first_group_id=first_group)
        rollout_s = time.perf_counter() - t0
        metrics = self.update(trajectories, step=step, sync=False)
        if not metrics["update/skipped"]:
            # Generators get the new weights before the next step samples (synchronous RL).
            t1 = time.perf_counter()
            if inspect.isawaitable(result := self._sync(step=step)):
                await result
            metrics["time/weight_sync_s"] = time.perf_counter() - t1
        rewards = np.asarray([t.reward for t in trajectories])
        sandbox_s = float(sum(t.tool_seconds for t in trajectories))
        metrics.update({
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/truncated_ratio": float(np.mean([t.truncated for t in trajectories])),
            "rollout/response_length_mean": float(np.mean([len(t.response_ids) for t in trajectories])),
            "rollout/tool_calls_mean": float(np.mean([t.n_tool_calls for t in trajectories])),
            # Turns the generators retracted under KV pressure and recomputed (SGLang's num_retractions).
            "rollout/retractions": int(sum(t.n_retractions for t in trajectories)),
            "time/rollout_s": rollout_s,
            "rollout/sampled_tokens_per_s": sum(t.num_sampled_tokens for t in trajectories) / max(rollout_s, 1e-9),
            # Summed over trajectories: sandbox round trips overlap each other and generation.
            "time/sandbox_calls_s": sandbox_s,
            "time/sandbox_call_mean_s": sandbox_s / max(1, sum(t.n_tool_calls for t in trajectories)),
        })
        return metrics, trajectories
