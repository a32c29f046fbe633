"""Asynchronous RL (rl.max_staleness = K >= 1) as users run it: the launcher in a subprocess on one
CPU device, from the tiny run's SFT warm-up export, against the local sandbox, with the in-process
engine (colocated) and with two `rstar_jax.serve` servers (disaggregated), and killed and resumed.

Every sampled token's version is read from the stored rollouts (`policy_version_runs`, beside the
`trained_version` of the update that trained it), so the staleness bound is checked on every token.
"""

import collections
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from rstar_jax.app import builders
from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.rollout.records import iter_rollouts
from rstar_jax.train.metrics import read_metrics
from tests.conftest import TINY_TEST_TASK, xla_flags

pytestmark = pytest.mark.slow  # launcher subprocesses

# Data order 3 from the warm policy updates from the first step (see test_resume.py).
COMMON = (*TINY_TEST_TASK, "--config.sft.before_rl=false", "--config.data.shuffle_seed=3",
          "--config.optim.warmup_steps=0", "--config.metrics.progress_bar=false", "--config.train.steps=3")


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    return env


def _command(run_dir, warm_policy, *overrides):
    return [sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={run_dir}",
            f"--config.model.hf_path={warm_policy}", *COMMON, *overrides]


def _run(run_dir, warm_policy, *overrides) -> subprocess.CompletedProcess:
    result = subprocess.run(_command(run_dir, warm_policy, *overrides), cwd=run_dir.parent, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def warm_policy(tiny_run_dir) -> pathlib.Path:
    return tiny_run_dir / "hf" / "sft_warmup"


def _check_run(run: pathlib.Path, k: int, overlapped: int) -> list[dict]:
    """The bound on every token, the pipeline's metrics, and nothing lost; returns the records.
    `overlapped`: a step (1-based) whose successor was generated beside it, so that an update there
    leaves the successor's tokens one version behind."""
    records = list(iter_rollouts(run))
    lines = [m for m in read_metrics(run) if "rollout/reward_mean" in m]
    assert [m["step"] for m in lines] == [1, 2, 3]
    # The versions the generators held: 0, then the step of each update (a skipped step pushes none).
    held = [0] + [m["step"] for m in lines if m["update/skipped"] == 0]
    lags = collections.Counter()
    for r in records:
        for version, count in r["policy_version_runs"]:
            if version >= 0:  # -1: tool tokens
                assert version in held and r["trained_version"] in held
                lags[held.index(r["trained_version"]) - held.index(version)] += count  # updates in between
        assert sum(n for v, n in r["policy_version_runs"] if v >= 0) == r["num_sampled_tokens"]
    assert lags and min(lags) >= 0 and max(lags) <= k
    if lines[overlapped - 1]["update/skipped"] == 0:
        assert max(lags) >= 1  # the next step was generated while this one trained
    for m in lines:
        assert m["async/staleness_max"] <= k
        assert {"async/trainer_wait_s", "async/generator_wait_s", "async/trainer_busy", "async/generator_busy"} <= m.keys()
        # The off-policy correction is on by default (rl.rollout_is "token"); its mismatch metrics
        # come from the loss pass, which a step whose groups RoC all filtered out does not run.
        assert ("mismatch/kl_k3" in m) == (m["update/skipped"] == 0)
    assert any(m["update/skipped"] == 0 for m in lines)
    # Nothing lost: each step's 4 groups of 8 are trained on or counted as dropped stale.
    per_step = collections.Counter(r["step"] for r in records)
    for m in lines:
        assert per_step[m["step"]] == 8 * (4 - m["async/stale_groups_dropped"])
    return records


@pytest.mark.parametrize("mode", ["pause", "in_place"])
def test_disaggregated_k1_pushes_in_flight_and_interrupted_trajectories_continue(tmp_path, warm_policy, mode):
    """Two serve processes; each push pauses them, swaps and resumes. "pause" (abort): aborted turns
    continue from their partial output under the new weights and are scored like any other.
    "in_place": running turns freeze and go on, nothing is aborted, and each token keeps the
    version that sampled it (the servers' per-token spans). (Whether a push lands mid-turn depends
    on timing; tests/rollout/test_rollout_loop_engine.py and tests/train/test_weight_sync.py make it
    happen.)"""
    run = tmp_path / "servers" / "run"
    run.parent.mkdir()
    result = _run(run, warm_policy, "--config.rl.max_staleness=1", "--config.rollout.backend=sglang",
                  "--config.rollout.local_servers=2", f"--config.weight_sync.mode={mode}")
    assert f"(float32, mode {mode}) to 2 server(s)" in result.stdout
    assert "[rl] asynchronous: rollouts run up to 1 step(s) ahead of the update (rl.max_staleness); " \
           "rollout correction rl.rollout_is=token" in result.stdout
    records = _check_run(run, 1, overlapped=1)
    interrupted = [r for r in records if len({v for v, _ in r["policy_version_runs"] if v >= 0}) > 1]
    if mode == "pause":
        assert all(r["n_abort_resumes"] > 0 for r in interrupted)
    else:
        assert all(r["n_abort_resumes"] == 0 for r in records)
    assert all(r["finish_reason"] != "aborted" and r["reward"] in (0.0, 1.0) for r in interrupted)


def test_colocated_k2_killed_and_resumed_completes_from_its_data_position(tmp_path, warm_policy):
    """K = 2 on the in-process engine, killed after checkpoint 1 with steps 2 and 3 in flight: the
    restart generates them again from the prompts and group ids that follow step 1 ("exact" here: the
    same data, group ids and sampling seeds; not the same tokens, since the restarted rollouts run
    under the restored policy rather than beside the lost process's updates), the metrics continue,
    and every token of the whole run is at most 2 versions behind."""
    run = tmp_path / "resumed" / "run"
    run.parent.mkdir()
    overrides = ("--config.rl.max_staleness=2", "--config.checkpoint.every_steps=1")
    process = subprocess.Popen(_command(run, warm_policy, *overrides), cwd=run.parent, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while not (run / "checkpoints" / "1").is_dir():
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "checkpoint 1 never appeared"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its sandbox server
        process.wait()
    restart = _run(run, warm_policy, *overrides)
    assert "[rl] resumed from step 1" in restart.stdout
    records = _check_run(run, 2, overlapped=2)
    config = load_config_file(str(REPO_CONFIGS / "tiny.py"))
    config.data.shuffle_seed = 3
    stream, _ = builders.prompt_iterator(config, [str(run / "data" / "train.jsonl")], builders.tokenizer(config))
    # Updates take complete groups from any batch read ahead (group streaming), so a step's groups
    # may come from several batches: each group's question is its batch's prompt in the stream that
    # follows the data position, and no group is trained twice across the kill and the restart.
    question = {4 * batch + j: e.question for batch in range(6) for j, e in enumerate(next(stream))}
    steps_of = collections.defaultdict(set)
    for r in records:
        assert r["question"] == question[r["group_id"]]
        steps_of[r["group_id"]].add(r["step"])
    assert all(len(steps) == 1 for steps in steps_of.values())
