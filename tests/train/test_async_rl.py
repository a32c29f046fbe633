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
from rstar_jax.train.loop import PromptLookahead, RLLoop, drop_stale_groups, stream_continuation


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
    at that moment (what the engine's in-place swap records); an update takes time, then pushes.
    `rollout_s(step)` is a batch's duration, or `group_s(step, index)` each group's."""

    def __init__(self, rollout_s, update_s, fail_at=None, skip=(), group_s=None):
        self.rollout_s, self.update_s, self.fail_at, self.skip = rollout_s, update_s, fail_at, set(skip)
        self.group_s = group_s or (lambda step, index: rollout_s(step))
        self.weights_version = 0
        self.events: list[tuple] = []
        self.trained_versions: dict[int, list[int]] = {}
        self.trained_groups: dict[int, list[int]] = {}
        self.generated: list[int] = []  # group ids, in the order their generation started
        self.steps_done = 0

    @staticmethod
    def gather_shares(own):  # one process
        return own

    @staticmethod
    def own_group_ids(prompts, *, step):
        return [step * len(prompts) + g for g in range(len(prompts))]

    async def generate(self, prompts, *, step):  # the synchronous step's
        groups = await asyncio.gather(*(self._group(step, g, step * len(prompts) + g) for g in range(len(prompts))))
        return [t for group in groups for t in group], self.rollout_s(step)

    async def _group(self, step, index, gid):
        self.generated.append(gid)
        trajectories = [_trajectory(gid, []) for _ in range(2)]
        for _ in range(4):  # tokens sampled in four bursts over the group's duration
            await asyncio.sleep(self.group_s(step, index) / 4)
            if step == self.fail_at:
                raise RuntimeError("generator lost")
            for t in trajectories:
                t.policy_versions.append(self.weights_version)
                t.loss_mask.append(1)
                t.response_ids.append(5)
                t.sampler_logprobs.append(0.0)
        return trajectories

    async def generate_groups(self, prompts, *, step, skip=frozenset()):
        self.events.append(("start", step, self.steps_done))
        tasks = [asyncio.ensure_future(self._group(step, g, gid))
                 for g, gid in enumerate(self.own_group_ids(prompts, step=step)) if gid not in skip]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def finish(self, trajectories, *, step, rollout_s, in_thread=False, train_on=None):
        train_on = trajectories if train_on is None else train_on
        self.events.append(("train", step, self.weights_version))
        self.trained_versions[step] = sorted({v for t in train_on for v in t.policy_versions})
        self.trained_groups[step] = sorted({t.group_id for t in train_on})
        self.dropped = getattr(self, "dropped", 0) + len(trajectories) - len(train_on)
        await asyncio.sleep(self.update_s)
        self.steps_done += 1
        if step in self.skip:  # every group all-correct or all-wrong: no update, no push
            return {"rollout/reward_mean": 1.0, "update/skipped": 1}
        self.weights_version = step + 1  # the push: the version is the step of the update
        return {"rollout/reward_mean": 1.0, "update/skipped": 0}


    async def astep(self, prompts, *, step):  # as RLTrainer.astep: the synchronous step
        self.events.append(("start", step, self.steps_done))
        trajectories, rollout_s = await self.generate(prompts, step=step)
        return await self.finish(trajectories, step=step, rollout_s=rollout_s), trajectories


class _Metrics:
    def __init__(self):
        self.lines = []

    def write(self, step, values):
        self.lines.append((step, dict(values)))
        return dict(values)


def _run(trainer, k, steps=6, start=0, state=None):
    """`steps` steps from `start` (from a checkpoint's data `state` when given); returns the metrics
    and, after each step, (step, the data state a checkpoint then holds)."""
    metrics, saved = _Metrics(), []
    prompts = _Batches()
    prompts.position = start
    lookahead = PromptLookahead(prompts, batch=start)
    if state is not None:
        lookahead.set_state(state)
    loop = RLLoop(trainer, lookahead if k else prompts, steps, metrics, checkpointer=None,
                  save_state=lambda step, final: saved.append((step, lookahead.get_state())),
                  lr=lambda step: 0.0, progress=False, max_staleness=k)
    asyncio.run(loop.run(start))
    return metrics, saved


def _resumes_exactly(trainer, saved, prompts_per_batch=2):
    """Each checkpoint's data state names exactly the groups not yet taken: every group of earlier
    batches and every listed one was trained, and no other."""
    trained = set()
    for step, state in saved:
        trained |= set(trainer.trained_groups[step - 1])
        first_open = state["batch"] * prompts_per_batch
        listed = {b * prompts_per_batch + i for b, i in state["taken"]}
        assert state["next"] == state["batch"]  # the data position of that batch
        assert trained == set(range(first_open)) | listed, (step, state)


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
    # Step 0's long batch was overtaken: steps 0 .. K - 1 trained later batches' groups as they came,
    # and step K, the first update after which its tokens would be too stale, waited for it (due).
    assert trainer.trained_groups[0] == [2, 3] and trainer.trained_groups[k] == [0, 1]
    assert lines[0]["async/groups_overtaking"] == 2
    # Each checkpoint resumes from the oldest batch not wholly trained, whatever was read ahead.
    _resumes_exactly(trainer, saved)
    assert saved[0][1]["batch"] == 0 and saved[0][1]["taken"] == [[1, 0], [1, 1]]


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
    assert [step for step, _ in metrics.lines] == [4, 5, 6]
    assert [(step, state["batch"], state["taken"]) for step, state in saved] == [(4, 4, []), (5, 5, []), (6, 6, [])]


def test_groups_stream_past_a_long_tail_and_a_resume_regenerates_only_the_groups_not_taken():
    """Group 0 (step 0's first) is slow: updates take the complete groups of later batches meanwhile
    and take group 0 once it falls due (K updates after its admission), within the bound. A run
    resumed from a checkpoint taken while group 0 was still out generates group 0 and the groups not
    taken again, skips those taken, and trains every group once in all."""
    slow = lambda step, index: 0.4 if (step, index) == (0, 0) else 0.03  # noqa: E731
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.03, update_s=0.03, group_s=slow)
    metrics, saved = _run(trainer, 2, steps=5)
    lines = [values for _, values in metrics.lines]
    where = {gid: step for step, gids in trainer.trained_groups.items() for gid in gids}
    assert where[0] == 2 and where[1] == 0  # group 0 waited for no update until it was due
    assert lines[0]["async/groups_overtaking"] >= 1 and all(v["async/stale_groups_dropped"] == 0 for v in lines)
    assert all(v["async/staleness_max"] <= 2 for v in lines) and lines[-1]["async/groups_left_untaken"] == 0
    assert sorted(where) == list(range(10))  # 5 steps x 2 groups, each once
    _resumes_exactly(trainer, saved)
    step, state = saved[0]  # after step 1: batch 0's group 0 still out, later groups taken
    assert state["batch"] == 0 and [0, 0] not in state["taken"] and [0, 1] in state["taken"]

    resumed = _ScriptedTrainer(rollout_s=lambda s: 0.03, update_s=0.03, group_s=slow)
    resumed.weights_version = resumed.steps_done = step
    _, saved_again = _run(resumed, 2, steps=5, start=step, state=state)
    taken_before = {b * 2 + i for b, i in state["taken"]}
    assert not taken_before & set(resumed.generated)  # nothing taken is generated again
    assert 0 in resumed.generated
    again = [gid for s in range(step, 5) for gid in resumed.trained_groups[s]]
    assert len(again) == len(set(again)) == 2 * (5 - step) and 0 in again and not taken_before & set(again)


def test_a_stage_continuing_an_asynchronous_one_starts_after_every_batch_it_trained_a_group_of():
    """`train.init_from` from an asynchronous stage's checkpoint taken while a group was out
    (`stream_continuation`): the next stage's stream starts after the last batch with a group taken,
    so no group is trained twice, and its group ids go on from there; the groups never taken (in
    flight when the stage stopped) are skipped. A synchronous stage's stream goes on after its step."""
    slow = lambda step, index: 0.4 if (step, index) == (0, 0) else 0.03  # noqa: E731
    trainer = _ScriptedTrainer(rollout_s=lambda s: 0.03, update_s=0.03, group_s=slow)
    _, saved = _run(trainer, 2, steps=5)
    step, state = saved[0]  # after step 1: batch 0's group 0 still out, groups of later batches taken
    skip, batches = stream_continuation(state, step)
    trained = set(trainer.trained_groups[0])
    assert state["batch"] == 0 and skip == max(b for b, _ in state["taken"]) + 1 and batches == skip
    assert batches > step  # a group numbering that went on from the step would reuse the ids of taken groups
    assert trained == {b * 2 + i for b, i in state["taken"]} and max(trained) < 2 * batches
    assert 0 not in trained  # skipped: it was still out
    assert stream_continuation({"next": 3}, 3) == (0, 3)  # synchronous
    assert stream_continuation({"next": 4, "batch": 4, "taken": []}, 4) == (0, 4)  # asynchronous, all taken


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
