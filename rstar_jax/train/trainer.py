"""One GRPO-RoC RL step (rStar2-Agent §1.2), composed from the project's pieces.

Per step: prompts -> 2G trajectories each (async, multi-turn, tools in the sandbox) -> rewards ->
RoC (drop all-equal groups, keep G) -> advantages over kept rollouts -> fixed-shape micro-batches
placed over the mesh's data-parallel axes -> one jitted, sharded, donated update -> weight sync to
the generators. A step in which every group was dropped makes no update (the spec's skipped step).

Log-probs are taken at the sampling temperature: the sampler's log-probs are log-softmax of the
temperature-scaled logits, and the trainer's π_old and π_θ divide the logits by the same
temperature (as verl does), so the ratio compares like with like.

The trainer receives its tool executor and scorer from the caller (the launcher wires the sandbox
client and the verifier), so the loop itself never runs untrusted code.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.parallel import multihost
from rstar_jax.rl.loss import finalize_metrics
from rstar_jax.rollout.loop import Scorer, ToolExecutor
from rstar_jax.rollout.orchestrator import Orchestrator, trajectory_runner
from rstar_jax.rollout.protocol import Generator, Scheduler
from rstar_jax.rollout.stats import rollout_stats
from rstar_jax.rollout.trajectory import Trajectory, pack_trajectories, unpack_trajectories
from rstar_jax.rollout.workers import RolloutWorkers
from rstar_jax.train.metrics import flops_per_token, peak_flops_for, throughput
from rstar_jax.train.rl_batch import PreparedBatch, prepare_batch
from rstar_jax.train.settings import RLSettings
from rstar_jax.train.step import compute_logprobs, place_batch, train_step
from rstar_jax.train.weight_sync import WeightSync


class RLTrainer:
    """GRPO-RoC steps of `model` with trajectories from a generator (or a scheduler over several;
    neither when only `update` is used, with trajectories from elsewhere).

    mesh: where the policy lives; batches are placed over its data-parallel axes (None: default
    placement, one device). weight_sync: how updated weights reach the generators; it holds the
    version they report. rollout_workers: started worker processes that run the rollouts instead of
    this process (the same trajectories; `rstar_jax.rollout.workers`).
    """

    def __init__(self, model, optimizer, tokenizer: Tokenizer, settings: RLSettings, *, executor: ToolExecutor,
                 scorer: Scorer, weight_sync: WeightSync, generator: Generator | None = None,
                 scheduler: Scheduler | None = None, template: ChatTemplate | None = None,
                 mesh: jax.sharding.Mesh | None = None, rollout_workers: RolloutWorkers | None = None):
        if generator is not None and scheduler is not None:
            raise ValueError("RLTrainer takes a generator (one engine) or a scheduler (several), not both")
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.settings = settings
        self.weight_sync = weight_sync
        self.mesh = mesh
        self.template = template or ChatTemplate(tool_name=settings.loop.tool_name)
        self.rollout_workers = rollout_workers
        self._run_one = trajectory_runner(generator, tokenizer, executor, config=settings.loop, scorer=scorer,
                                          template=self.template, scheduler=scheduler)

    def _orchestrator(self) -> Orchestrator | RolloutWorkers:
        """What runs a batch's trajectories: the worker processes when given, else this event loop."""
        if self.rollout_workers is not None:
            return self.rollout_workers
        return Orchestrator(self._run_one, max_concurrency=self.settings.max_concurrency)

    @property
    def weights_version(self) -> int:
        return self.weight_sync.version

    async def sync_weights(self, version: int) -> float:
        """Pushes the current policy to the generators as `version`; returns the seconds it took."""
        t0 = time.perf_counter()
        await self.weight_sync.push(self.model, version)
        return time.perf_counter() - t0

    async def rollout(self, prompts: list[tuple[str, str]], *, first_group_id: int = 0) -> list[Trajectory]:
        """2G trajectories per prompt; group ids from `first_group_id` (seeded sampling derives each
        trajectory's draws from its group id, so a resumed step repeats the same draws)."""
        return await self._orchestrator().collect(prompts, self.settings.rollouts_per_prompt, first_group_id=first_group_id)

    async def rollout_shared(self, prompts: list[tuple[str, str]], *, first_group_id: int = 0) -> list[Trajectory]:
        """`rollout` of all `prompts` over the job's processes: each generates the groups of its
        contiguous share (group ids as one process would number them) and every process gets all
        trajectories, in group order. RoC, advantages and the batch are then the same on every
        process (and the same as one process's), and each process places its rows of it."""
        return self.gather_shares(await self.rollout_own_share(prompts, first_group_id=first_group_id))

    async def rollout_own_share(self, prompts: list[tuple[str, str]], *, first_group_id: int = 0) -> list[Trajectory]:
        """This process's contiguous share of `rollout_shared`'s groups (all of them in one process)."""
        if jax.process_count() == 1:
            return await self.rollout(prompts, first_group_id=first_group_id)
        mine = multihost.share(len(prompts))
        return await self.rollout(prompts[mine], first_group_id=first_group_id + mine.start)

    @staticmethod
    def gather_shares(own: list[Trajectory]) -> list[Trajectory]:
        """Every process's share, on every process, in group order (a collective: all processes call
        it at the same point of their run)."""
        if jax.process_count() == 1:
            return own
        # Token arrays, not JSON: several times fewer bytes through the collective (pack_trajectories).
        gathered = multihost.allgather_arrays(*pack_trajectories(own))
        return [t for arrays, meta in gathered for t in unpack_trajectories(arrays, meta)]

    def prepare(self, trajectories: list[Trajectory], *, step: int) -> PreparedBatch:
        """RoC and advantages into fixed-shape micro-batches (host arrays). RoC's random choice is
        seeded with (the run's seed, step): each step draws afresh and a resumed run draws as the
        uninterrupted one did."""
        s = self.settings
        seed = int(np.random.SeedSequence([s.seed, step]).generate_state(1)[0])
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return prepare_batch(trajectories, s.roc, s.batch, seed=seed, decode=decode,
                             advantage_estimator=s.loss.advantage_estimator)

    def update(self, trajectories: list[Trajectory], *, step: int) -> dict[str, Any]:
        """RoC, advantages and the jitted update (no weight sync); returns this step's metrics."""
        s = self.settings
        t0 = time.perf_counter()
        prepared = self.prepare(trajectories, step=step)
        kept = set(prepared.roc.kept_indices.tolist())
        for i, trajectory in enumerate(trajectories):  # stored with the rollout records
            trajectory.extra["roc_kept"] = i in kept
        metrics: dict[str, Any] = dict(prepared.roc.stats())
        if prepared.skipped:
            metrics["update/skipped"] = 1
            return metrics
        batch = place_batch(prepared.batch, self.mesh)
        temperature = jnp.float32(s.loop.temperature)
        if not s.batch.use_sampler_logprobs:
            # π_old recomputed by the trainer (as verl does); sampler log-probs stay for the drift metric.
            old, _ = compute_logprobs(self.model, batch, chunk_size=s.chunk_size, temperature=temperature)
            batch["old_logprobs"] = jnp.where(batch["loss_mask"] > 0, old, 0.0)
        out = jax.device_get(train_step(self.model, self.optimizer, batch, s.loss, s.chunk_size, temperature))
        update_s = time.perf_counter() - t0
        tokens = int(np.count_nonzero(prepared.batch["segment_ids"]))
        # Training FLOPs of the real (unpadded) tokens at the mean packed sequence length; the
        # π_old recomputation adds a forward (a third) when the trainer recomputes it.
        mean_length = max(1, tokens // max(1, len(prepared.roc.kept_indices)))
        flops = flops_per_token(self.model.config, mean_length).flops_per_token
        if not s.batch.use_sampler_logprobs:
            flops *= 4.0 / 3.0
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        metrics.update({f"update/{k}": v for k, v in throughput(
            tokens, update_s, flops, num_devices=len(devices),
            peak_flops_per_device=peak_flops_for(devices[0].device_kind)).items()})
        metrics.update(finalize_metrics(out))
        metrics.update({"update/tokens": tokens, "update/loss": float(out["loss"]),
                        "update/grad_norm": float(out["grad_norm"]), "update/skipped": 0,
                        "time/update_s": time.perf_counter() - t0})
        return metrics

    async def generate(self, prompts: list[tuple[str, str]], *, step: int) -> tuple[list[Trajectory], float]:
        """Step `step`'s trajectories (group ids from step x prompts) and the seconds they took."""
        t0 = time.perf_counter()
        trajectories = await self.rollout_shared(prompts, first_group_id=step * len(prompts))
        return trajectories, time.perf_counter() - t0

    def own_group_ids(self, prompts: list[tuple[str, str]], *, step: int) -> list[int]:
        """The group ids of this process's share of step `step`'s groups (`generate`'s numbering)."""
        first_group_id = step * len(prompts)
        mine = multihost.share(len(prompts)) if jax.process_count() > 1 else slice(0, len(prompts))
        return list(range(first_group_id + mine.start, first_group_id + mine.stop))

    def generate_groups(self, prompts: list[tuple[str, str]], *, step: int,
                        skip: frozenset[int] = frozenset()) -> AsyncIterator[list[Trajectory]]:
        """This process's share of step `step`'s groups, numbered as `generate` numbers them, each
        yielded as soon as its 2G trajectories finish (asynchronous RL's group streaming); groups
        whose ids are in `skip` are not generated. Close it (`contextlib.aclosing`) to cancel the rest."""
        first_group_id = step * len(prompts)
        numbered = [(gid, *prompts[gid - first_group_id]) for gid in self.own_group_ids(prompts, step=step)
                    if gid not in skip]
        return self._orchestrator().numbered_groups(numbered, self.settings.rollouts_per_prompt)

    async def finish(self, trajectories: list[Trajectory], *, step: int, rollout_s: float,
                     in_thread: bool = False, train_on: list[Trajectory] | None = None) -> dict:
        """The update of step `step` on `trajectories` (or on `train_on`, those of them that may be
        trained), the push of version step + 1 when it updated, and the step's metrics (the
        rollout's over all `trajectories`). `in_thread`: the update runs off the event loop, so
        rollouts of later steps go on meanwhile (asynchronous RL)."""
        train_on = trajectories if train_on is None else train_on
        if not train_on:
            metrics: dict[str, Any] = {"update/skipped": 1}
        elif in_thread:
            metrics = await asyncio.to_thread(self.update, train_on, step=step)
        else:
            metrics = self.update(train_on, step=step)
        if not metrics["update/skipped"]:
            metrics["time/weight_sync_s"] = await self.sync_weights(step + 1)
            # Server syncs split it: the trainer's export, the transfer, forming the group.
            metrics.update({f"time/weight_sync_{k}": v for k, v in self.weight_sync.stats().items()})
        stats = rollout_stats(trajectories)
        sandbox_s = float(sum(t.tool_seconds for t in trajectories))
        metrics.update({f"rollout/{k}": v for k, v in stats.items()})
        metrics.update({
            "rollout/sampled_tokens_per_s": stats["sampled_tokens"] / max(rollout_s, 1e-9),
            "time/rollout_s": rollout_s,
            # Summed over trajectories: sandbox round trips overlap each other and generation.
            "time/sandbox_calls_s": sandbox_s,
            "time/sandbox_call_mean_s": sandbox_s / max(1, sum(t.n_tool_calls for t in trajectories)),
        })
        return metrics

    async def astep(self, prompts: list[tuple[str, str]], *, step: int) -> tuple[dict, list[Trajectory]]:
        """One RL step (0-based `step`: group ids and RoC's draw derive from it, so a step is
        reproducible from its number alone). Generators get the new weights, version step + 1,
        before the next step samples (synchronous RL)."""
        trajectories, rollout_s = await self.generate(prompts, step=step)
        return await self.finish(trajectories, step=step, rollout_s=rollout_s), trajectories
