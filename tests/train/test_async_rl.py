"""Asynchronous RL (rl.max_staleness = K): the pipeline's admission, ordering and accounting against
a scripted trainer whose rollouts take time and whose tokens carry the version in force when each was
sampled; the stale-group filter; the prompt look-ahead's data position; the config's checks.

The launcher's real runs (engine, sandbox, kill and resume) are in tests/app/test_async_launch.py.
"""

import asyncio
import dataclasses

import pytest

from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file, resolve, validate
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.loop import PromptLookahead, RLLoop, drop_stale_groups


def _trajectory(group_id, versions, reward=1.0):
    n = len(versions)
    return Trajectory(prompt_ids=[1], response_ids=[5] * n, loss_mask=[1 if v >= 0 else 0 for v in versions],
                      sampler_logprobs=[0.0] * n, policy_versions=list(versions), group_id=group_id, reward=reward)


def test_stale_groups_are_dropped_whole_and_counted():
    trajectories = [_trajectory(0, [5, 5, -1, 4]), _trajectory(0, [5]),  # staleness 1 and 0 at version 5
                    _trajectory(1, [3, 5]), _trajectory(1, [5]),  # one token 2 behind: the group goes
                    _trajectory(2, [-1, -1])]  # no sampled tokens: no staleness to judge
    kept, metrics = drop_stale_groups(trajectories, held=[3, 4, 5], max_staleness=1)
    assert [t.group_id for t in kept] == [0, 0, 2]
    assert metrics["async/stale_groups_dropped"] == 1
    assert metrics["async/staleness_max"] == 1
    assert metrics["async/staleness_mean"] == pytest.approx(1 / 4)
    assert metrics["async/staleness_0_share"] == pytest.approx(3 / 4)
    assert metrics["async/staleness_1_share"] == pytest.approx(1 / 4)
    kept, metrics = drop_stale_groups(trajectories, held=[3, 4, 5], max_staleness=2)
    assert len(kept) == 5 and metrics["async/stale_groups_dropped"] == 0 and metrics["async/staleness_max"] == 2
    # A version is the step of its update, so a skipped step (4: no update, no push) leaves a gap:
    # staleness counts the updates in between, not the version numbers.
    kept, metrics = drop_stale_groups(trajectories, held=[3, 5], max_staleness=1)
    assert len(kept) == 5 and metrics["async/staleness_max"] == 1


class _Batches:
    """A prompt iterator whose state is the index of the next batch."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        self.position += 1
        return [dataclasses.make_dataclass("Example", ["question", "answer"])(f"q{self.position - 1}-{i}", "1")
                for i in range(2)]

    def get_state(self):
        return {"next": self.position}

    def set_state(self, state, **_):
        self.position = state["next"]


class _ScriptedTrainer:
    """Rollouts sample tokens over simulated time, each labelled with the version the generators hold
    at that moment (what the engine's in-place swap records); an update takes time, then pushes."""

    def __init__(self, rollout_s, update_s, fail_at=None, skip=()):
        self.rollout_s, self.update_s, self.fail_at, self.skip = rollout_s, update_s, fail_at, set(skip)
        self.weights_version = 0
        self.events: list[tuple] = []
        self.trained_versions: dict[int, list[int]] = {}
        self.steps_done = 0

    @staticmethod
    def gather_shares(own):  # one process
        return own

    async def generate(self, prompts, *, step, own_share=False):
        self.events.append(("start", step, self.steps_done))
        trajectories = [_trajectory(step * len(prompts) + g, []) for g in range(len(prompts)) for _ in range(2)]
        for _ in range(4):  # tokens sampled in four bursts over the rollout's duration
            await asyncio.sleep(self.rollout_s(step) / 4)
            if step == self.fail_at:
                raise RuntimeError("generator lost")
            for t in trajectories:
                t.policy_versions.append(self.weights_version)
                t.loss_mask.append(1)
                t.response_ids.append(5)
                t.sampler_logprobs.append(0.0)
        return trajectories, self.rollout_s(step)

    async def finish(self, trajectories, *, step, rollout_s, in_thread=False, train_on=None):
        train_on = trajectories if train_on is None else train_on
        self.events.append(("train", step, self.weights_version))
        self.trained_versions[step] = sorted({v for t in train_on for v in t.policy_versions})
        self.dropped = getattr(self, "dropped", 0) + len(trajectories) - len(train_on)
        await asyncio.sleep(self.update_s)
        self.steps_done += 1
        if step in self.skip:  # every group all-correct or all-wrong: no update, no push
            return {"rollout/reward_mean": 1.0, "update/skipped": 1}
        self.weights_version = step + 1  # the push: the version is the step of the update
        return {"rollout/reward_mean": 1.0, "update/skipped": 0}


    async def astep(self, prompts, *, step):  # as RLTrainer.astep: the synchronous step
        trajectories, rollout_s = await self.generate(prompts, step=step)
        return await self.finish(trajectories, step=step, rollout_s=rollout_s), trajectories


class _Metrics:
    def __init__(self):
        self.lines = []

    def write(self, step, values):
        self.lines.append((step, dict(values)))
        return dict(values)


def _run(trainer, k, steps=6, start=0):
    metrics, saved = _Metrics(), []
    prompts = _Batches()
    prompts.position = start
    lookahead = PromptLookahead(prompts)
    loop = RLLoop(trainer, lookahead if k else prompts, steps, metrics, checkpointer=None,
                  save_state=lambda step, final: saved.append((step, lookahead.get_state()["next"])),
                  lr=lambda step: 0.0, progress=False, max_staleness=k)
    asyncio.run(loop.run(start))
    return metrics, saved


@pytest.mark.parametrize("k", [1, 2])
def test_pipeline_admits_k_steps_ahead_and_no_token_is_more_than_k_behind(k):
    # A long first rollout (its tail), then quick ones beside slow updates: generation runs ahead.
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.2 if s == 0 else 0.04, update_s=0.06)
    metrics, saved = _run(trainer, k)
    starts = {step: done for kind, step, done in trainer.events if kind == "start"}
    trains = [(step, version) for kind, step, version in trainer.events if kind == "train"]
    assert [s for s, _ in trains] == list(range(6))  # every step trained once, in order
    for step, done in starts.items():
        assert done >= step - k  # admission: step s starts once step s - K - 1 is trained
    assert any(done < step for step, done in starts.items())  # and some did start ahead
    for step, version in trains:
        lags = [version - v for v in trainer.trained_versions[step]]
        assert max(lags) <= k
    assert max(max(version - v for v in trainer.trained_versions[s]) for s, version in trains) == k
    lines = [values for _, values in metrics.lines]
    assert [step for step, _ in metrics.lines] == list(range(1, 7))
    assert all(v["async/stale_groups_dropped"] == 0 and v["async/staleness_max"] <= k for v in lines)
    for v in lines:
        assert 0 < v["async/trainer_busy"] <= 1 and 0 <= v["async/generator_busy"] <= 1 + 1e-6
    # Generation runs ahead, beside the updates (a rollout of 0.04 s in a step of about 0.06 s): the
    # generators are busy for a good part of each step, where a synchronous loop leaves them idle
    # through every update.
    assert sum(v["async/generator_busy"] for v in lines[1:]) / 5 > 0.25
    # The checkpoint after step s resumes from step s + 1's prompts, whatever was read ahead.
    assert saved == [(s, s) for s in range(1, 7)]


def test_skipped_steps_do_not_make_tokens_stale():
    """Versions are step numbers, so after a skipped step the next push jumps by two: staleness counts
    updates, and nothing generated within the bound is dropped."""
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.2 if s == 0 else 0.04, update_s=0.06, skip={1, 3})
    metrics, _ = _run(trainer, 1)
    lines = [values for _, values in metrics.lines]
    assert trainer.dropped == 0 and all(v["async/stale_groups_dropped"] == 0 for v in lines)
    assert all(v["async/staleness_max"] <= 1 for v in lines)
    trains = [(step, version) for kind, step, version in trainer.events if kind == "train"]
    assert any(version - min(trainer.trained_versions[step]) == 2 for step, version in trains)  # a version gap


def test_k0_is_sequential():
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.02, update_s=0.02)
    metrics, _ = _run(trainer, 0)
    kinds = [(kind, step) for kind, step, _ in trainer.events]
    assert kinds == [(kind, s) for s in range(6) for kind in ("start", "train")]
    assert all(trainer.trained_versions[s] == [s] for s in range(6))  # every token sampled by the trained policy
    assert not any(key.startswith("async/") for _, values in metrics.lines for key in values)


def test_a_failed_rollout_ends_the_run_with_its_error():
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.02, update_s=0.05, fail_at=2)
    with pytest.raises(RuntimeError, match="generator lost"):
        _run(trainer, 1)
    assert [step for kind, step, _ in trainer.events if kind == "train"] == [0, 1]


def test_resumed_pipeline_starts_from_its_checkpointed_step():
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.02, update_s=0.02)
    trainer.weights_version = trainer.steps_done = 3
    metrics, saved = _run(trainer, 1, steps=6, start=3)
    assert [step for kind, step, _ in trainer.events if kind == "train"] == [3, 4, 5]
    assert [step for step, _ in metrics.lines] == [4, 5, 6] and saved == [(4, 4), (5, 5), (6, 6)]


def _tiny(**overrides):
    config = load_config_file(str(REPO_CONFIGS / "tiny.py"))
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(config, section), name, value)
    return config


def test_config_checks_and_the_default_correction():
    assert resolve.loss_config(_tiny()).rollout_is is None
    assert resolve.rl_settings(_tiny(**{"rl.max_staleness": 2})).max_staleness == 2
    assert resolve.loss_config(_tiny(**{"rl.max_staleness": 1})).rollout_is == "token"
    assert resolve.loss_config(_tiny(**{"rl.max_staleness": 1, "rl.rollout_is": "sequence"})).rollout_is == "sequence"
    assert resolve.loss_config(_tiny(**{"rl.max_staleness": 1, "rl.use_sampler_logprobs": True})).rollout_is is None
    with pytest.raises(ConfigError, match=r"config\.rl\.max_staleness: must be a non-negative integer"):
        validate(_tiny(**{"rl.max_staleness": -1}))
    with pytest.raises(ConfigError, match=r"config\.weight_sync\.mode: must be 'pause', 'in_place' or 'abort'"):
        validate(_tiny(**{"rl.max_staleness": 1, "rollout.backend": "sglang", "rollout.local_servers": 2}))
    for mode in ("pause", "in_place"):
        validate(_tiny(**{"rl.max_staleness": 1, "rollout.backend": "sglang", "rollout.local_servers": 2,
                          "weight_sync.mode": mode}))
