"""benchmarks/rollout_sim.py: the rollout simulator runs the real schedulers against simulated engines
in virtual time, every trajectory finishes under every policy, and its engines behave like SGLang's."""

import asyncio
import importlib.util
import pathlib
import re
import sys

import pytest

from rstar_jax.rollout.protocol import Generator, SamplingParams
from rstar_jax.rollout.scheduler import KvScheduler

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_sim.py"


@pytest.fixture(scope="module")
def sim():
    """The script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("rollout_sim_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look the module up while it loads
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def h100(sim):
    return sim.PROFILES["h100-qwen3-14b"](1)


def test_tiny_scale_runs_every_policy_and_ends_with_the_speed_up_line(sim, capsys):
    lines = sim.main(["--scale", "tiny", "--seed", "3"])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == lines[-1]
    match = re.fullmatch(r"dynamic_vs_static=(\d+\.\d\d) dynamic_vs_static_sync=(\d+\.\d\d)", lines[-1])
    assert match and all(float(x) > 0 for x in match.groups())
    assert sum(line.split()[0] in sim.POLICIES for line in lines) == 3


def test_every_trajectory_finishes_in_every_policy(sim, h100):
    plans = sim.paper_workload(4, 8, budget=8192, max_turns=10, seed=1)
    planned = sum(min(p.intended, 8192) for p in plans)
    for policy in sim.POLICIES:
        result = sim.simulate(policy, plans, [(h100.pool_tokens, 64)] * 2, h100, budget=8192)
        assert result.finished == len(plans) and result.makespan > 0
        # every planned token is sampled except those cut by the budget (truncated trajectories)
        assert result.tokens <= planned and result.tokens > 0.8 * planned
        assert 0.0 <= result.idle_fraction < 1.0


def test_same_seed_same_figures(sim, h100):
    def run():
        plans = sim.paper_workload(2, 8, budget=4096, max_turns=10, seed=5)
        return [sim.simulate(p, plans, [(20000, 64)] * 2, h100, budget=4096).makespan for p in sim.POLICIES]

    assert run() == run()


def test_simulated_engines_are_generators(sim, h100):
    engine = sim.SimEngine("e0", h100)
    assert isinstance(engine, Generator)
    assert isinstance(sim.SimEngine("e1", sim.CPU_TINY), Generator)


def test_virtual_clock_jumps_instead_of_sleeping(sim):
    async def hour():
        await asyncio.gather(asyncio.sleep(1800), asyncio.sleep(3600))
        return asyncio.get_running_loop().time()

    assert sim.run_virtual(hour()) == pytest.approx(3600)

    async def never():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(sim.SimulationStalled):
        sim.run_virtual(never())


def test_long_simulated_workload_finishes(sim, h100):
    """One engine whose pool holds one worst-case turn at a time: the dynamic policy runs the 32
    trajectories' turns one after another, well over 1000 simulated seconds, and the test still takes seconds."""
    plans = sim.paper_workload(1, 32, budget=8192, max_turns=10, seed=0)
    pool = int(1.5 * (max(p.prompt for p in plans) + 8192))
    result = sim.simulate("dynamic", plans, [(pool, 64)], h100, budget=8192, reservation="worst-case")
    assert result.finished == 32 and result.makespan > 1000
    assert result.peak_running == [1]


def test_retractions_when_the_pool_is_tiny(sim, h100):
    plans = sim.paper_workload(1, 16, budget=4096, max_turns=4, seed=2)
    result = sim.simulate("static", plans, [(12000, 64)], h100, budget=4096)
    assert result.finished == 16 and result.retractions > 0


def test_dynamic_policy_drives_the_kv_scheduler(sim, h100):
    made = []

    def make(gens, fraction, reservation):
        made.append(KvScheduler(gens, budget_fraction=fraction, reservation=reservation))
        return made[-1]

    plans = sim.paper_workload(2, 8, budget=4096, max_turns=10, seed=4)
    result = sim.simulate("dynamic", plans, [(30000, 64)] * 2, h100, budget=4096, make_scheduler=make,
                          budget_fraction=0.5)
    scheduler = made[0]
    assert sum(scheduler.admitted_per_generator()) == len(plans) and result.finished == len(plans)
    assert len(plans) < scheduler.turns <= sum(len(p.turns) for p in plans)  # turn by turn
    assert placed_together(plans, scheduler)
    assert all((ledger.reserved, ledger.parked, ledger.running) == (0, 0, 0) for ledger in scheduler.ledgers)


def placed_together(plans, scheduler) -> bool:
    """Each group's trajectories started on one engine (two groups of 8 fit one engine's budget each)."""
    return sorted(scheduler.admitted_per_generator()) == [8, 8]


def test_engine_prefix_cache_stop_length_and_abort(sim, h100):
    async def scenario():
        engine = sim.SimEngine("e", h100)
        first = await engine.generate(sim.SimTokens("t", 100, next_turn=50), SamplingParams(max_new_tokens=200))
        second = await engine.generate(sim.SimTokens("t", 170, next_turn=30), SamplingParams(max_new_tokens=10))
        used = (await engine.capacity()).used_tokens
        task = asyncio.ensure_future(engine.generate(sim.SimTokens("u", 100), SamplingParams(max_new_tokens=1000),
                                                     rid="00000000000000aa"))
        await asyncio.sleep(1.0)
        running = await engine.capacity()
        await engine.abort("00000000000000aa")
        aborted = await task
        return first, second, used, running, aborted

    first, second, used, running, aborted = sim.run_virtual(scenario())
    assert (first.finish_reason, len(first.token_ids)) == ("stop", 50)
    assert (second.finish_reason, len(second.token_ids), second.cached_tokens) == ("length", 10, 149)
    assert used == 0 and running.running_requests == 1 and running.used_tokens > 100
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 1000


def test_small_scale_mirrors_rollout_balance(sim):
    lines = sim.main(["--scale", "small", "--pool", "16384"])
    assert any(line.startswith("real engines (RESULTS.md") for line in lines)
    assert lines[0].startswith("workload: 96 trajectories")
    plans = sim.small_workload(96, budget=768, prompt_len=32, observation=16, turn_median=40.0, tool_latency=0.02,
                               seed=0)
    assert sum(sum(p.turns) for p in plans) == 16589  # rollout_balance.py's workload (RESULTS.md)
