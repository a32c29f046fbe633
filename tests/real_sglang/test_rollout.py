"""The rollout side against real SGLang 0.5.23 servers, on the tiny run's warmed-up policy (it writes
Python tool calls): multi-turn trajectories with tool calls in a real sandbox placed by the KV
scheduler (their sampler log-probs are the JAX policy's), a server killed mid-step, and the main job
itself (`python -m rstar_jax.launch`) training against a real server with the disk weight sync."""

import asyncio
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.agent.reward import make_scorer
from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.config import resolve
from rstar_jax.data.synthetic import generate_problems
from rstar_jax.model.hf import load_pretrained
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.rollout.loop import run_trajectory
from rstar_jax.rollout.orchestrator import Orchestrator
from rstar_jax.rollout.scheduler import KvScheduler
from rstar_jax.rollout.sglang import SGLangGenerator
from rstar_jax.rollout.stats import rollout_stats
from rstar_jax.app import builders
from sandbox_service.client import SandboxClient
from sandbox_service.launcher import LocalSandbox
from tests.conftest import TINY_TEST_TASK

CONTEXT, POOL = 1024, 8192
KIND = "last_digit_power"  # the task the tiny run's policy was warmed up on (TINY_TEST_TASK)


@pytest.fixture(scope="module")
def policy_dir(tiny_run_dir):
    return tiny_run_dir / "hf" / "sft_warmup"


@pytest.fixture(scope="module")
def setup():
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.data.synthetic.kinds = (KIND,)
    return config, resolve.loop_config(config), builders.tokenizer(config), builders.template(config)


def _collect(generators, setup, problems, samples, *, scheduler=None, during=None):
    """Runs `samples` trajectories per problem on `generators` behind a KV scheduler, with every tool
    call in a real sandbox; `during(generators)` runs alongside."""
    config, loop, tokenizer, template = setup

    async def main(target):
        gens = [SGLangGenerator(url, generate_timeout_s=120) for url in generators]
        sched = scheduler or KvScheduler(gens)
        scorer = make_scorer("local", timeout_s=10)
        try:
            async with SandboxClient(target, **loop.tool_env.sandbox_options()) as client:
                async def one(question, gold, group, index):
                    return await run_trajectory(None, tokenizer, client, question, gold, config=loop, scorer=scorer,
                                                template=template, scheduler=sched, group_id=group, sample_index=index)

                side = asyncio.ensure_future(during(gens)) if during else None
                try:
                    trajectories = await Orchestrator(one, max_concurrency=16).collect(
                        [(p.question, p.answer) for p in problems], samples)
                finally:
                    if side is not None:
                        side.cancel()
                return trajectories, sched, gens
        finally:
            scorer.close()
            for g in gens:
                await g.close()

    with LocalSandbox(workers=2) as sandbox:
        return asyncio.run(main(sandbox.target))


def _policy_logprobs(model, trajectory):
    """log p(token | context) under the JAX policy for every response token (temperature 1)."""
    ids = trajectory.prompt_ids + trajectory.response_ids
    with jax.default_matmul_precision("highest"):
        logits = model(jnp.asarray([ids[:-1]]))[0]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.asarray(ids[1:])
    return np.asarray(jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0])[len(trajectory.prompt_ids) - 1:]


def test_multi_turn_tool_trajectories_on_a_real_server(start_sglang, policy_dir, setup):
    """Trajectories grow by appending ids (never re-tokenized): every sampled token's SGLang log-prob
    is the JAX policy's for the same context, across tool turns."""
    server = start_sglang(policy_dir, context_length=CONTEXT, max_total_tokens=POOL)
    # 32 trajectories: SGLang's CPU engine ignores sampling seeds, and the weakly warmed-up test policy
    # calls the tool in only some of its answers, so 16 left fewer than 3 tool turns in one run of two.
    problems = generate_problems(8, seed=11, kinds=(KIND,))
    trajectories, scheduler, _ = _collect([server.url], setup, problems, 4)
    assert len(trajectories) == 32
    stats = rollout_stats(trajectories)
    assert sum(t.n_tool_calls for t in trajectories) >= 3 and sum(t.n_turns > 1 for t in trajectories) >= 3, stats
    assert stats["rejected"] == 0 and stats["context_truncated"] == 0 and stats["failovers"] == 0
    assert scheduler.admitted == 32 and scheduler.turns >= 32 + sum(t.n_tool_calls > 0 for t in trajectories)
    model = load_pretrained(policy_dir)
    for t in trajectories:
        t.check()
        sampled = np.asarray(t.loss_mask, bool)
        np.testing.assert_allclose(np.asarray(t.sampler_logprobs)[sampled], _policy_logprobs(model, t)[sampled],
                                   atol=2e-3)
    print(f"real SGLang rollout: {stats['tool_calls_mean']:.2f} tool calls, {stats['turns_mean']:.2f} turns per "
          f"trajectory, pass rate {stats['pass_rate']:.2f}")


def test_a_real_server_killed_mid_step_leaves_the_rotation(start_sglang, policy_dir, setup):
    """One real SGLang server and one `rstar_jax.serve` with the same policy: the SGLang server's
    process tree is killed while it generates; its trajectories resume on the other server from
    their last complete turn, and every trajectory of the step finishes."""
    import signal

    server = start_sglang(policy_dir, context_length=CONTEXT, max_total_tokens=POOL)
    problems = generate_problems(4, seed=12, kinds=(KIND,))
    killed = []

    async def kill_when_busy(gens):
        while (await gens[0].capacity()).running_requests < 2:
            await asyncio.sleep(0.05)
        os.killpg(server.process.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    with LocalServer(str(policy_dir), slots=8, max_length=CONTEXT) as survivor:
        trajectories, scheduler, gens = _collect([server.url, survivor.url], setup, problems, 4,
                                                 during=kill_when_busy)
    assert killed, "the real server was never busy enough to be killed"
    assert len(trajectories) == 16 and sorted((t.group_id, t.sample_index) for t in trajectories) == [
        (g, i) for g in range(4) for i in range(4)]
    assert scheduler.is_down(gens[0]) and not scheduler.is_down(gens[1])
    stats = rollout_stats(trajectories)
    assert stats["failovers"] >= 1 and stats["rejected"] == 0, stats
    for t in trajectories:
        t.check()
        assert t.num_sampled_tokens > 0


def test_the_main_job_trains_against_a_real_server(start_sglang, policy_dir, tmp_path):
    """`python -m rstar_jax.launch` with `rollout.servers` naming a real SGLang server: trajectories
    placed by the KV scheduler, and after each update an HF export loaded by the server
    (`/update_weights_from_disk`), whose version the next step's tokens carry."""
    from rstar_jax.rollout.records import iter_rollouts

    server = start_sglang(policy_dir, context_length=CONTEXT, max_total_tokens=POOL)
    run = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")}
    result = subprocess.run(
        [sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={run}", f"--config.model.hf_path={policy_dir}",
         *TINY_TEST_TASK, "--config.sft.before_rl=False", "--config.train.steps=2", "--config.data.shuffle_seed=3",
         "--config.rollout.backend=sglang", f"--config.rollout.servers=('{server.url}',)",
         "--config.metrics.progress_bar=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rl] weight sync: HF export to" in result.stdout and "[rl] done" in result.stdout
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["rollout/rejected"] == 0 and m["rollout/context_truncated"] == 0 for m in lines)
    assert sum(m["rollout/tool_calls_mean"] for m in lines) > 0
    updated = [m["step"] for m in lines if m["update/skipped"] == 0]
    assert updated, "no step updated the policy"
    records = list(iter_rollouts(run))
    assert len(records) == 2 * 4 * 8
    if updated[0] < 2:
        versions = {r["policy_version"] for r in records if r["step"] == updated[0] + 1 and r["num_sampled_tokens"]}
        assert versions == {updated[0]}

    async def version():
        async with SGLangGenerator(server.url) as gen:
            return await gen.weight_version()

    assert asyncio.run(version()) == str(updated[-1])
