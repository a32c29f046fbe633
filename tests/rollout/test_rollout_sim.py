"""benchmarks/rollout_sim.py: the rollout simulator runs the real schedulers against simulated engines
in virtual time, every trajectory finishes under every policy, and its engines behave like SGLang's."""

import asyncio
import re

import pytest

from rstar_jax.rollout.protocol import Generator, SamplingParams
from rstar_jax.rollout.scheduler import KvScheduler
from tests.benchmark_scripts import benchmark_script



@pytest.fixture(scope="module")
def sim():
    """The script as a module (benchmarks/ is not a package)."""
    with benchmark_script("rollout_sim") as module:
        yield module


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


# -- the trainer: several RL steps ----------------------------------------------------------------
def tiny_workload(sim, seed=3, prompts=4, group=8, **kw):
    return lambda b: sim.paper_workload(prompts, group, budget=8192, max_turns=10, seed=seed + b, **kw)


def train(sim, h100, policy, trainer=None, *, engines=2, steps=4, workload=None, **kw):
    return sim.simulate_training(policy, workload or tiny_workload(sim), [(h100.pool_tokens, 1024)] * engines, h100,
                                 trainer or sim.TrainerModel(), steps=steps, budget=8192, reconcile_interval=10.0,
                                 **kw)


def test_trainer_mode_at_tiny_scale_ends_with_the_async_vs_sync_line(sim, capsys):
    lines = sim.main(["--scale", "tiny", "--trainer", "--seed", "3"])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == lines[-1]
    match = re.fullmatch(r"async_vs_sync=(\d+\.\d\d)", lines[-1])
    assert match and float(match.group(1)) > 0
    rows = [line.split()[0] for line in lines if line.split()[0] in sim.TRAINING_POLICIES]
    assert sorted(set(rows)) == sorted(sim.TRAINING_POLICIES)
    assert any("4 RL steps" in line for line in lines)  # the run says how short it is


def test_update_and_push_times_reproduce_a_hand_computation(sim):
    trainer = sim.TrainerModel(gpu=sim.H100, mfu=0.4, push_gbps=2.0, push_overhead_s=1.5)
    # two sampled sequences of 1000 and 3000 tokens, half of them trained (RoC: 16 of 32), pi_old's
    # forward recomputed (a third more): 4/3 x 0.5 x (6 x 14.8e9 x 4000 + 6 x 40 x 40 x 128 x (1000^2 + 3000^2))
    flops = 4 / 3 * 0.5 * (3.552e14 + 1.2288e13)
    assert trainer.update_flops([1000, 3000]) == pytest.approx(flops, rel=1e-12)
    assert trainer.update_seconds([1000, 3000], gpus=8) == pytest.approx(flops / (0.4 * 989e12 * 8), rel=1e-12)
    # 14.8e9 bf16 parameters = 29.6 GB at 2 GB/s, plus the pause and resume
    assert trainer.push_seconds() == pytest.approx(29.6 / 2.0 + 1.5, rel=1e-12)
    assert sim.TrainerModel().push_seconds() == pytest.approx(29.6 / 1.34 + 1.0, rel=1e-12)


def test_sync_colocated_rollout_is_the_single_step_simulation(sim, h100):
    """Step 0's rollout under sync-colocated (and async-colocated at K = 0, the same thing) ends when
    simulate("dynamic") says the step's rollout ends; every later step starts after the push."""
    single = sim.simulate("dynamic", tiny_workload(sim)(0), [(h100.pool_tokens, 1024)] * 2, h100, budget=8192,
                          reconcile_interval=10.0)
    sync = train(sim, h100, "sync-colocated")
    assert sync.batch_ends[0] == pytest.approx(single.makespan, rel=1e-12, abs=1e-9)
    k0 = train(sim, h100, "async-colocated", max_staleness=0)
    assert k0.step_ends == sync.step_ends and k0.staleness == sync.staleness == {0: 4 * 32}
    for s in range(1, 4):  # batch s is generated between the end of push s - 1 and update s
        assert sync.step_ends[s - 1] < sync.batch_ends[s] <= sync.update_starts[s]
        assert sync.update_starts[s] == pytest.approx(sync.batch_ends[s])
    assert sync.step_ends[0] == pytest.approx(single.makespan + sync.update_s[0] + sync.push_s)


@pytest.mark.parametrize("policy,k,split", [("async-colocated", 1, None), ("async-colocated", 2, None),
                                            ("async-disaggregated", 1, 1), ("async-disaggregated", 0, 1)])
def test_staleness_is_bounded_and_every_started_trajectory_is_accounted_for(sim, h100, policy, k, split):
    result = train(sim, h100, policy, max_staleness=k, gen_engines=split, steps=5)
    assert result.trained == 5 * 32 and sum(result.staleness.values()) == result.trained
    assert max(result.staleness) <= k
    assert result.started == result.trained + result.dropped + result.buffered + result.in_flight
    assert result.started <= (5 + k) * 32  # admission: at most (version + K + 1) x B groups
    assert len(result.step_ends) == 5 and all(a < b for a, b in zip(result.step_ends, result.step_ends[1:]))


def test_async_beats_sync_when_the_long_tail_dominates(sim, h100):
    """A fast update (the tiny batch on 2 GPUs: about 8 s against a 100 s rollout whose last tenth is
    one 8K-token straggler group): the trainer starts on complete groups and the engines keep busy."""
    sync = train(sim, h100, "sync-colocated")
    colocated = train(sim, h100, "async-colocated")
    assert colocated.steady_steps_per_hour > 1.2 * sync.steady_steps_per_hour
    assert colocated.gen_busy > 0 and sync.trainer_busy < colocated.trainer_busy


def test_async_cannot_win_when_the_update_dominates(sim, h100):
    """An update far longer than the rollout (MFU 0.2%: about 30 minutes against 2 minutes): all async-
    colocated can hide is the rollout's tail, and disaggregation halves the trainer's GPUs."""
    slow = sim.TrainerModel(mfu=0.002)
    sync = train(sim, h100, "sync-colocated", slow)
    assert min(sync.update_s) > 10 * max(sync.batch_ends[0], 60.0)
    colocated = train(sim, h100, "async-colocated", slow)
    disaggregated = train(sim, h100, "async-disaggregated", slow, gen_engines=1)
    assert colocated.steady_steps_per_hour < 1.1 * sync.steady_steps_per_hour
    assert disaggregated.steady_steps_per_hour < 0.6 * sync.steady_steps_per_hour
    assert disaggregated.trainer_busy > 0.9


def test_engine_pause_holds_generation_and_release_recomputes(sim, h100):
    async def one(pause_at=None, release=False):
        engine = sim.SimEngine("e", h100)
        task = asyncio.ensure_future(engine.generate(sim.SimTokens("t", 1000, next_turn=2000),
                                                     sim.SamplingParams(max_new_tokens=4000)))
        if pause_at is not None:
            await asyncio.sleep(pause_at)
            engine.pause(pause_at + 30.0, release=release, version=1)
            await asyncio.sleep(1.0)
            used = (await engine.capacity()).used_tokens
            assert engine.version == 0 and (used == 0 if release else 1000 < used < 1100)
            assert engine.running == (0 if release else 1)
        result = await task
        engine.finish_idle(asyncio.get_running_loop().time())
        return asyncio.get_running_loop().time(), result, engine

    plain_end, plain, _ = sim.run_virtual(one())
    kept_end, kept, kept_engine = sim.run_virtual(one(pause_at=0.5))  # paused while decoding
    released_end, released, released_engine = sim.run_virtual(one(pause_at=0.5, release=True))
    assert len(plain.token_ids) == len(kept.token_ids) == len(released.token_ids) == 2000
    assert kept_end == pytest.approx(plain_end + 30.0, abs=0.1) and kept_engine.version == 1
    assert kept_engine.paused_s == pytest.approx(30.0, abs=0.1) and kept.num_retractions == 0
    assert released.num_retractions == 1 and released_engine.released == 1
    assert released_engine.prefill_tokens > kept_engine.prefill_tokens  # its context prefilled again
    assert released_end > kept_end


@pytest.mark.slow
def test_trainer_at_a_larger_scale(sim, h100):
    """16 prompts x 32 rollouts on 8 engines over 3 steps: the same properties where the KvScheduler
    spreads groups over engines, and a split sweep whose best lies inside it: 7 + 1 GPUs starve the
    trainer, 4 + 4 the generators."""
    workload = tiny_workload(sim, seed=0, prompts=16, group=32)
    single = sim.simulate("dynamic", workload(0), [(h100.pool_tokens, 1024)] * 8, h100, budget=8192,
                          reconcile_interval=10.0)
    sync = train(sim, h100, "sync-colocated", engines=8, steps=3, workload=workload)
    assert sync.batch_ends[0] == pytest.approx(single.makespan, rel=1e-12, abs=1e-9)
    rate = {}
    for policy, split in (("async-colocated", None), ("async-disaggregated", 7), ("async-disaggregated", 6),
                          ("async-disaggregated", 5), ("async-disaggregated", 4)):
        result = train(sim, h100, policy, engines=8, steps=3, workload=workload, gen_engines=split)
        assert max(result.staleness) <= 1 and result.trained == 3 * 16 * 32
        assert result.started == result.trained + result.dropped + result.buffered + result.in_flight
        rate[split] = result.steady_steps_per_hour
    assert rate[None] > 1.1 * sync.steady_steps_per_hour
    best = max(rate[6], rate[5])
    assert best > sync.steady_steps_per_hour and best > max(rate[7], rate[4])
