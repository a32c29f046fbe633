"""Exact resume: a run killed with SIGKILL and restarted ends bitwise where an uninterrupted run ends.

Both runs are the launcher as users run it (subprocesses, one CPU device). The RL runs start from
the tiny run's SFT warm-up export, whose rollout groups are mixed, so every step really updates the
policy; sampling is seeded per trajectory, so the restarted run must repeat the same data order,
the same trajectories and the same updates.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.rollout.records import iter_rollouts
from rstar_jax.app import builders
from rstar_jax.train.metrics import read_metrics
from tests.conftest import TINY_TEST_SFT, TINY_TEST_TASK, xla_flags

pytestmark = pytest.mark.slow  # killed and resumed launcher subprocesses


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    return env


def _command(run_dir, *overrides):
    return [sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={run_dir}", "--config.metrics.progress_bar=false",
            *overrides]


def _run(run_dir, *overrides) -> subprocess.CompletedProcess:
    result = subprocess.run(_command(run_dir, *overrides), cwd=run_dir.parent, env=_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _kill_after_checkpoint(run_dir: pathlib.Path, step: int, *overrides, directory: str = "checkpoints") -> None:
    """Starts the run, waits until checkpoint `step` is committed, then SIGKILLs the process."""
    process = subprocess.Popen(_command(run_dir, *overrides), cwd=run_dir.parent, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    committed = run_dir / directory / str(step)
    deadline = time.monotonic() + 300
    try:
        while not committed.is_dir():
            if process.poll() is not None:
                raise AssertionError(f"run ended before checkpoint {step}: {process.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"checkpoint {step} never appeared")
            time.sleep(0.05)
    finally:
        # The whole session: the launcher and the sandbox server it started.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _weights(run_dir: pathlib.Path) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "hf" / "final" / "model.safetensors"))


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), f"tensor {name} differs after resume"


@pytest.fixture(scope="module")
def warm_policy(tiny_run_dir) -> pathlib.Path:
    return tiny_run_dir / "hf" / "sft_warmup"


# Killing after the step-1 checkpoint makes step 2 start from restored parameters *and* Adam
# moments (an update when its groups are mixed, which depends on XLA's numerics: jax 0.11.2 drops
# them at this data order). No warm-up, so step 1's update has a learning rate (a one-step linear
# warm-up starts at 0) and the policy changes whatever step 2 does.
RL = (*TINY_TEST_TASK, "--config.sft.before_rl=false", "--config.train.steps=2", "--config.checkpoint.every_steps=1",
      "--config.data.shuffle_seed=3", "--config.optim.warmup_steps=0")


def test_rl_run_killed_and_resumed_matches_the_uninterrupted_run_bitwise(tmp_path, warm_policy):
    policy = f"--config.model.hf_path={warm_policy}"
    straight, resumed = tmp_path / "straight" / "run", tmp_path / "resumed" / "run"
    straight.parent.mkdir()
    resumed.parent.mkdir()
    _run(straight, policy, *RL)
    _kill_after_checkpoint(resumed, 1, policy, *RL)
    assert not (resumed / "hf" / "final").exists()
    restart = _run(resumed, policy, *RL)
    assert "[rl] resumed from step 1" in restart.stdout

    _assert_bitwise_equal(_weights(straight), _weights(resumed))
    # Same data order and the same trajectories, step by step (including the re-run step).
    a, b = list(iter_rollouts(straight)), list(iter_rollouts(resumed))
    assert [(r["step"], r["question"], r["response_ids"]) for r in a] == \
           [(r["step"], r["question"], r["response_ids"]) for r in b]
    # The policy really changed.
    rl_lines = [m for m in read_metrics(straight) if "rollout/reward_mean" in m]
    assert any(m["update/skipped"] == 0 for m in rl_lines)
    warm = load_file(str(warm_policy / "model.safetensors"))
    assert any(not np.array_equal(warm[k], v) for k, v in _weights(straight).items())
    # The resumed run's log has each step once, as the uninterrupted one.
    resumed_lines = [m for m in read_metrics(resumed) if "rollout/reward_mean" in m]
    assert [m["step"] for m in resumed_lines] == [1, 2]
    for x, y in zip(rl_lines, resumed_lines):
        assert x.get("update/loss") == y.get("update/loss")


SFT = ("--config.mode=sft", *TINY_TEST_SFT, "--config.sft.epochs=1", "--config.data.synthetic.sft_stages=((32,(0,1,0)),(16,(0.4,0.3,0.3)))",
       "--config.checkpoint.every_steps=4", "--config.checkpoint.export_hf_every=0")


def test_sft_run_killed_and_resumed_matches_the_uninterrupted_run_bitwise(tmp_path):
    straight, resumed = tmp_path / "straight" / "run", tmp_path / "resumed" / "run"
    straight.parent.mkdir()
    resumed.parent.mkdir()
    _run(straight, *SFT)
    _kill_after_checkpoint(resumed, 4, *SFT)
    restart = _run(resumed, *SFT)
    assert "[sft] resumed from step" in restart.stdout
    _assert_bitwise_equal(_weights(straight), _weights(resumed))
    assert [m["step"] for m in read_metrics(resumed)] == [m["step"] for m in read_metrics(straight)] == \
           list(range(1, 13))
    losses = [m["sft/loss"] for m in read_metrics(straight)]
    assert losses == [m["sft/loss"] for m in read_metrics(resumed)]
    assert json.loads((straight / "data" / "sft_0.jsonl").read_text().splitlines()[0])["messages"]


def test_sft_stage_ended_early_resumes_to_the_same_end(tmp_path):
    """sft.advance_loss: a run killed inside the stage that later ends early takes the same decision
    after its restart (the stage's recent losses are in the checkpoint) and ends bitwise the same."""
    import re

    advance = (*SFT, "--config.sft.advance_loss=3.6", "--config.sft.advance_window=2")
    straight, resumed = tmp_path / "straight" / "run", tmp_path / "resumed" / "run"
    straight.parent.mkdir()
    resumed.parent.mkdir()
    ended = re.search(r"\[sft\] stage 1 ended at step (\d+) of 8", _run(straight, *advance).stdout)
    assert ended and 4 < int(ended[1]) < 8, "the stage must end after the checkpoint the restart resumes from"
    _kill_after_checkpoint(resumed, 4, *advance)
    restart = _run(resumed, *advance)
    assert "[sft] resumed from step 4" in restart.stdout and ended[0] in restart.stdout
    _assert_bitwise_equal(_weights(straight), _weights(resumed))
    steps = [m["step"] for m in read_metrics(straight)]
    assert steps == [m["step"] for m in read_metrics(resumed)] == [*range(1, int(ended[1]) + 1), 9, 10, 11, 12]
    assert [m["sft/loss"] for m in read_metrics(straight)] == [m["sft/loss"] for m in read_metrics(resumed)]


WARM_UP = (*TINY_TEST_TASK, *TINY_TEST_SFT, "--config.sft.epochs=1", "--config.data.synthetic.sft_stages=((32,(0,1,0)),(16,(0.4,0.3,0.3)))",
           "--config.checkpoint.every_steps=4", "--config.checkpoint.export_hf_every=0", "--config.train.steps=1",
           "--config.train.eval_every=0")


def test_rl_warm_up_killed_and_resumed_continues_its_sft(tmp_path):
    """RL's SFT warm-up saves as it goes (`checkpoints_sft_warmup/`): a run killed in it resumes
    there, logs each SFT step once and warms up to the same policy as an uninterrupted run."""
    straight, resumed = tmp_path / "straight" / "run", tmp_path / "resumed" / "run"
    straight.parent.mkdir()
    resumed.parent.mkdir()
    _run(straight, *WARM_UP)
    _kill_after_checkpoint(resumed, 4, *WARM_UP, directory="checkpoints_sft_warmup")
    restart = _run(resumed, *WARM_UP)
    assert "[sft] resumed from step 4" in restart.stdout
    warm = [load_file(str(run / "hf" / "sft_warmup" / "model.safetensors")) for run in (straight, resumed)]
    _assert_bitwise_equal(*warm)
    sft_steps = [[m["step"] for m in read_metrics(run) if "sft/loss" in m] for run in (straight, resumed)]
    assert sft_steps[0] == sft_steps[1] == list(range(1, 13))
    assert [m["step"] for m in read_metrics(resumed) if "rollout/reward_mean" in m] == [1]


def test_next_stage_starts_from_the_previous_stages_checkpoint(tmp_path):
    """`train.init_from` (stage 2 and 3 configs): the policy comes from the previous stage's latest
    checkpoint, not from the stage's own initialisation; stage 3 resets the optimizer."""
    short = ("--config.sft.before_rl=false", "--config.train.eval_every=0", "--config.rollout.response_budget=32",
             "--config.data.num_prompts_per_step=2", "--config.train.steps=1")
    previous, following = tmp_path / "stage1" / "run", tmp_path / "stage2" / "run"
    previous.parent.mkdir()
    following.parent.mkdir()
    _run(previous, *short)
    # A different seed initialises different weights: only init_from can make them equal.
    result = _run(following, *short, "--config.seed=1", f"--config.train.init_from={previous}",
                  "--config.optim.reset_at_start=true")
    assert (f"[rl] initialised from {previous / 'checkpoints'} step 1 (optimizer reset); steps continue from 1, "
            "its prompt stream continued") in result.stdout
    # It continues the previous stage's run: its first prompts are the ones after the previous
    # stage's, and its group ids (from which sampling seeds derive) go on from the previous stage's.
    first, second = list(iter_rollouts(previous)), list(iter_rollouts(following))
    assert sorted({r["group_id"] for r in first}) == [0, 1] and sorted({r["group_id"] for r in second}) == [2, 3]
    config = load_config_file(str(REPO_CONFIGS / "tiny.py"))
    config.data.num_prompts_per_step = 2
    stream, _ = builders.prompt_iterator(config, [str(previous / "data" / "train.jsonl")], builders.tokenizer(config))
    assert [r["question"] for r in first][::len(first) // 2] == [e.question for e in next(stream)]
    assert [r["question"] for r in second][::len(second) // 2] == [e.question for e in next(stream)]
    # The random policy earns no reward, so neither stage updated: the weights passed through unchanged.
    assert all(m.get("update/skipped") == 1 for m in read_metrics(following) if "rollout/reward_mean" in m)
    _assert_bitwise_equal(_weights(previous), _weights(following))
