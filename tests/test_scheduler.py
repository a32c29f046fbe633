"""KvScheduler: capacity is never exceeded, no queued trajectory starves, leases are released on every exit."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar_jax.rollout.protocol import Capacity, GenerateResult, Scheduler
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler


class FakeGenerator:
    """A generator that only reports a capacity (and, optionally, tokens used by someone else)."""

    def __init__(self, name, total, used=0):
        self.name, self.total, self.used = name, total, used
        self.version = 0

    async def generate(self, input_ids, sampling, rid=None):
        return GenerateResult([], [], "stop")

    async def capacity(self):
        return Capacity(total_tokens=self.total, used_tokens=self.used)

    async def abort(self, rid):
        pass


def test_schedulers_implement_the_protocol():
    gens = [FakeGenerator("a", 100)]
    assert isinstance(KvScheduler(gens), Scheduler) and isinstance(RoundRobinScheduler(gens), Scheduler)


class RecordingScheduler(KvScheduler):
    """Records the order in which reservations are granted (a granted waiter resumes later)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grants = []

    def _grant(self, index, trajectory_id, tokens):
        self.grants.append(int(trajectory_id[1:]))
        super()._grant(index, trajectory_id, tokens)


@settings(max_examples=40, deadline=None)
@given(capacities=st.lists(st.integers(100, 1000), min_size=1, max_size=4),
       jobs=st.lists(st.tuples(st.floats(0.01, 1.0), st.integers(0, 6)), min_size=1, max_size=40),
       fraction=st.sampled_from([0.5, 0.9, 1.0]))
def test_reservations_never_exceed_capacity_and_nothing_starves(capacities, jobs, fraction):
    """Random worst-case sizes (as a share of the largest budget) and hold times (event-loop turns)."""
    gens = [FakeGenerator(f"g{i}", c) for i, c in enumerate(capacities)]
    scheduler = RecordingScheduler(gens, budget_fraction=fraction)
    largest = max(int(fraction * c) for c in capacities)
    arrival, admission = [], []

    def check():
        for i, ledger in enumerate(scheduler.ledgers):
            assert 0 <= ledger.reserved <= scheduler.budget(i)

    async def trajectory(j, share, hold):
        tokens = max(1, int(share * largest))
        arrival.append(j)
        async with scheduler.lease(f"t{j:04d}", tokens) as gen:
            admission.append(j)
            check()
            assert tokens <= scheduler.budget(gens.index(gen))
            for _ in range(hold):
                await asyncio.sleep(0)
                check()

    async def run():
        # Every job must finish: a starved one would hit the timeout.
        await asyncio.wait_for(asyncio.gather(*(trajectory(j, s, h) for j, (s, h) in enumerate(jobs))), 20)

    asyncio.run(run())
    assert sorted(admission) == list(range(len(jobs)))
    assert scheduler.grants == arrival  # FIFO: no queued trajectory is overtaken
    assert all(ledger.reserved == 0 and ledger.leases == 0 for ledger in scheduler.ledgers)


def test_most_free_budget_first_sticky_and_queueing():
    gens = [FakeGenerator("a", 1000), FakeGenerator("b", 600)]
    scheduler = KvScheduler(gens, budget_fraction=1.0)

    async def run():
        async with scheduler.lease("t1", 500) as g1:
            assert g1 is gens[0]  # 1000 free vs 600
            async with scheduler.lease("t2", 400) as g2:
                assert g2 is gens[1]  # 500 vs 600
                blocked = asyncio.ensure_future(_hold(scheduler, "t3", 550))
                await asyncio.sleep(0.01)
                assert not blocked.done() and scheduler.queued == 1  # 500 and 200 free: fits nowhere
            assert await blocked is gens[1]  # t2 released: 600 free on b
        async with scheduler.lease("t2", 100) as again:
            assert again is gens[1]  # sticky: t2 returns to the generator it ran on

    asyncio.run(run())


async def _hold(scheduler, tid, tokens):
    async with scheduler.lease(tid, tokens) as gen:
        return gen


def test_release_on_exception_and_cancellation():
    gens = [FakeGenerator("a", 100)]
    scheduler = KvScheduler(gens, budget_fraction=1.0)

    async def run():
        with pytest.raises(RuntimeError, match="boom"):
            async with scheduler.lease("t1", 80):
                raise RuntimeError("boom")
        assert scheduler.ledgers[0].reserved == 0
        async with scheduler.lease("t2", 80):
            waiting = asyncio.ensure_future(_hold(scheduler, "t3", 80))
            behind = asyncio.ensure_future(_hold(scheduler, "t4", 10))
            await asyncio.sleep(0.01)
            waiting.cancel()  # the blocking head leaves the queue; t4 may now go in
            assert await behind is gens[0]
        running = asyncio.ensure_future(_hold_forever(scheduler, "t5", 90))
        await asyncio.sleep(0.01)
        assert scheduler.ledgers[0].reserved == 90
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        assert scheduler.ledgers[0].reserved == 0 and scheduler.queued == 0

    asyncio.run(run())


async def _hold_forever(scheduler, tid, tokens):
    async with scheduler.lease(tid, tokens):
        await asyncio.sleep(3600)


def test_reconcile_counts_foreign_usage_and_rejects_impossible_leases():
    gens = [FakeGenerator("a", 1000, used=700), FakeGenerator("b", 1000)]
    scheduler = KvScheduler(gens, budget_fraction=1.0)

    async def run():
        async with scheduler.lease("t1", 400) as g:
            assert g is gens[1]
            assert scheduler.free(0) == 300 and scheduler.free(1) == 600
        with pytest.raises(ValueError, match="reserves 1001 tokens"):
            async with scheduler.lease("t2", 1001):
                pass
        with pytest.raises(ValueError, match="reserve_tokens"):
            async with scheduler.lease("t3", 0):
                pass
        gens[0].used = 0
        await scheduler.reconcile()
        assert scheduler.free(0) == 1000

    asyncio.run(run())


def test_round_robin_is_static():
    gens = [FakeGenerator(n, 10) for n in "abc"]
    scheduler = RoundRobinScheduler(gens)

    async def run():
        return [await _hold(scheduler, f"t{i}", 10**9) for i in range(6)]

    assert [g.name for g in asyncio.run(run())] == list("abcabc")
