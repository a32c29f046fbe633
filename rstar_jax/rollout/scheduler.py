"""Placing trajectories on generators: a KV-cache reservation ledger and a static round-robin baseline.

`KvScheduler` is the admission policy rStar2-Agent describes (and its release left out): each
trajectory reserves its worst-case KV footprint (context + remaining response budget) on one
generator for its whole life; it is admitted on the generator with the most free budget when it
fits there, and otherwise waits in a FIFO queue that is refilled as soon as a reservation is released.
The ledger is the primary signal; `reconcile()` corrects it with what the generators report
(`capacity()`, i.e. `/get_server_info` and `/v1/loads` or `/get_load` for SGLang servers).

`RoundRobinScheduler` assigns trajectories to generators in turn with no admission control, the
static policy the dynamic one is compared with.

Both take a failed generator out of rotation (`mark_down`, called by the rollout loop when a
generator is unavailable, or by `reconcile` when one cannot report): no lease goes to it afterwards,
and its trajectories resume elsewhere. When none is left, leases raise `GeneratorUnavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import AsyncIterator, Sequence

from rstar_jax.rollout.protocol import Generator, GeneratorUnavailable

log = logging.getLogger(__name__)

AFFINITY_MEMORY = 65536  # placements remembered after release, for sticky re-leases


@dataclasses.dataclass
class _Waiter:
    trajectory_id: str
    tokens: int
    future: asyncio.Future


class _Rotation:
    """Which generators are in rotation; a generator taken out stays out (its reason is kept)."""

    generators: list

    def _init_rotation(self) -> None:
        self.down: dict[int, str] = {}  # generator index -> why it left the rotation

    def _index(self, generator: Generator) -> int | None:
        return next((i for i, g in enumerate(self.generators) if g is generator), None)

    def is_down(self, generator: Generator) -> bool:
        """True once `generator` left the rotation (False for one this scheduler does not place on)."""
        return self._index(generator) in self.down

    def live(self) -> list[Generator]:
        """The generators still in rotation."""
        return [g for i, g in enumerate(self.generators) if i not in self.down]

    def mark_down(self, generator: Generator, reason: str) -> None:
        """Takes `generator` out of rotation (idempotent); new leases go to the others. A generator this
        scheduler does not place on (another process's share) is ignored."""
        index = self._index(generator)
        if index is None or index in self.down:
            return
        self.down[index] = str(reason)
        log.warning("generator %s taken out of rotation (%d of %d left): %s", getattr(generator, "name", index),
                    len(self.generators) - len(self.down), len(self.generators), reason)
        self._after_down()

    def _after_down(self) -> None:
        pass

    def _no_generator_left(self) -> GeneratorUnavailable:
        reasons = "; ".join(f"{getattr(self.generators[i], 'name', i)}: {r}" for i, r in self.down.items())
        return GeneratorUnavailable(f"every generator is out of rotation ({reasons})")


@dataclasses.dataclass
class GeneratorLedger:
    """The scheduler's view of one generator, in tokens."""

    capacity: int  # C_s: the generator's KV pool (max_total_num_tokens summed over its DP ranks)
    ranks: int = 1  # DP ranks: one request lives in one rank's pool, capacity / ranks
    reserved: int = 0  # R_s: sum of the live leases' reservations
    reported_used: int = 0  # what the generator last reported in use (reconcile)
    leases: int = 0
    peak_reserved: int = 0
    admitted: int = 0  # trajectories placed here so far


class KvScheduler(_Rotation):
    """KV-reservation admission over generators; implements `rstar_jax.rollout.protocol.Scheduler`.

    budget_fraction (alpha): the share of each generator's capacity that reservations may fill.
    capacities: per-generator capacity in tokens; read from `generator.capacity()` when omitted.
    reconcile_interval: seconds between automatic `reconcile()` calls made while leasing
    (None: only explicit calls and the first lease).
    """

    def __init__(self, generators: Sequence[Generator], *, budget_fraction: float = 0.9,
                 capacities: Sequence[int] | None = None, reconcile_interval: float | None = None):
        if not generators:
            raise ValueError("KvScheduler: generators must be non-empty")
        if not 0.0 < budget_fraction <= 1.0:
            raise ValueError(f"KvScheduler: budget_fraction must be in (0, 1], got {budget_fraction}")
        if capacities is not None and len(capacities) != len(generators):
            raise ValueError(f"KvScheduler: {len(capacities)} capacities for {len(generators)} generators")
        self.generators = list(generators)
        self.budget_fraction = budget_fraction
        self.reconcile_interval = reconcile_interval
        self._ledgers: list[GeneratorLedger] | None = (
            None if capacities is None else [GeneratorLedger(int(c)) for c in capacities])
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._holder: dict[str, int] = {}  # trajectory id -> generator index, while leased
        self._affinity: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._last_reconcile = 0.0
        self._init_lock = asyncio.Lock()
        self.admitted = 0
        self.max_queue = 0
        self._init_rotation()

    def admitted_per_generator(self) -> list[int]:
        """Trajectories placed on each generator so far (for load metrics)."""
        return [ledger.admitted for ledger in self._ledgers or []]

    # -- ledger -------------------------------------------------------------------------------
    @property
    def ledgers(self) -> list[GeneratorLedger]:
        if self._ledgers is None:
            raise RuntimeError("KvScheduler: capacities are not known yet (call reconcile() or lease first)")
        return self._ledgers

    def budget(self, index: int) -> int:
        """alpha * C_s: the most a generator's reservations may add up to."""
        return int(self.budget_fraction * self.ledgers[index].capacity)

    def largest_request(self, index: int) -> int:
        """The most one trajectory may reserve here: its share alpha of one DP rank's pool."""
        ledger = self.ledgers[index]
        return int(self.budget_fraction * ledger.capacity) // max(1, ledger.ranks)

    def free(self, index: int) -> int:
        """Free budget: alpha * C_s minus the larger of the ledger and the generator's own report."""
        ledger = self.ledgers[index]
        return self.budget(index) - max(ledger.reserved, ledger.reported_used)

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def reconcile(self) -> None:
        """Reads every generator's capacity and usage; tokens in use beyond the ledger (other
        clients, or a smaller pool than assumed) count as occupied. A generator that is unavailable
        leaves the rotation. Then refills from the queue."""
        live = [i for i in range(len(self.generators)) if i not in self.down]
        reports = dict(zip(live, await asyncio.gather(*(self.generators[i].capacity() for i in live),
                                                      return_exceptions=True)))
        for i, report in reports.items():
            if isinstance(report, GeneratorUnavailable):
                self.down[i] = f"capacity report failed: {report}"
                log.warning("generator %s taken out of rotation: %s", getattr(self.generators[i], "name", i),
                            self.down[i])
            elif isinstance(report, BaseException):
                raise report
        if self._ledgers is None:
            self._ledgers = [GeneratorLedger(0 if i in self.down else reports[i].total_tokens)
                             for i in range(len(self.generators))]
        for i, report in reports.items():
            if i not in self.down:
                self._ledgers[i].capacity = int(report.total_tokens)
                self._ledgers[i].ranks = max(1, int(report.ranks))
                self._ledgers[i].reported_used = int(report.used_tokens)
        self._last_reconcile = time.monotonic()
        self._after_down()

    async def _maybe_reconcile(self) -> None:
        async with self._init_lock:
            due = self.reconcile_interval is not None and (
                time.monotonic() - self._last_reconcile >= self.reconcile_interval)
            if self._ledgers is None or due:
                await self.reconcile()

    # -- placement ----------------------------------------------------------------------------
    def _place(self, trajectory_id: str, tokens: int) -> int | None:
        """Index of the generator to admit on, or None when it fits nowhere now."""
        home = self._affinity.get(trajectory_id)
        if (home is not None and home not in self.down and self.free(home) >= tokens
                and tokens <= self.largest_request(home)):
            return home  # sticky: the generator that already holds its prefix
        live = [i for i in range(len(self.generators)) if i not in self.down and tokens <= self.largest_request(i)]
        if not live:
            return None
        best = max(live, key=lambda i: (self.free(i), -i))
        return best if self.free(best) >= tokens else None

    def _grant(self, index: int, trajectory_id: str, tokens: int) -> None:
        ledger = self.ledgers[index]
        ledger.reserved += tokens
        ledger.leases += 1
        ledger.peak_reserved = max(ledger.peak_reserved, ledger.reserved)
        ledger.admitted += 1
        self._holder[trajectory_id] = index
        self.admitted += 1

    def _release(self, index: int, trajectory_id: str, tokens: int) -> None:
        ledger = self.ledgers[index]
        ledger.reserved -= tokens
        ledger.leases -= 1
        self._holder.pop(trajectory_id, None)
        self._affinity[trajectory_id] = index
        self._affinity.move_to_end(trajectory_id)
        while len(self._affinity) > AFFINITY_MEMORY:
            self._affinity.popitem(last=False)
        self._dispatch()

    def _dispatch(self) -> None:
        """Admits queued trajectories strictly in arrival order (no overtaking, so none starves)."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            index = self._place(head.trajectory_id, head.tokens)
            if index is None:
                return
            self._queue.popleft()
            self._grant(index, head.trajectory_id, head.tokens)
            head.future.set_result(index)

    def _after_down(self) -> None:
        """Queued trajectories that no live generator can hold fail (all of them when none is left);
        the others are placed as room allows."""
        live = [i for i in range(len(self.generators)) if i not in self.down]
        largest = max((self.largest_request(i) for i in live), default=0) if self._ledgers is not None else None
        waiting, self._queue = self._queue, collections.deque()
        for waiter in waiting:
            if waiter.future.done():
                continue
            if not live:
                waiter.future.set_exception(self._no_generator_left())
            elif largest is not None and waiter.tokens > largest:
                waiter.future.set_exception(GeneratorUnavailable(
                    f"trajectory {waiter.trajectory_id!r} reserves {waiter.tokens} tokens, more than any generator "
                    f"left in rotation can hold ({largest})"))
            else:
                self._queue.append(waiter)
        self._dispatch()

    @contextlib.asynccontextmanager
    async def lease(self, trajectory_id: str, reserve_tokens: int) -> AsyncIterator[Generator]:
        """Reserves `reserve_tokens` on one generator for the life of the context; waits while none has room."""
        if reserve_tokens < 1:
            raise ValueError(f"lease: reserve_tokens must be >= 1, got {reserve_tokens} for {trajectory_id!r}")
        if trajectory_id in self._holder:
            raise ValueError(f"lease: trajectory {trajectory_id!r} already holds a lease")
        await self._maybe_reconcile()
        if len(self.down) == len(self.generators):
            raise self._no_generator_left()
        largest = max(self.largest_request(i) for i in range(len(self.generators)) if i not in self.down)
        if reserve_tokens > largest:
            raise ValueError(f"lease: trajectory {trajectory_id!r} reserves {reserve_tokens} tokens, more than "
                             f"any generator's budget ({largest} = {self.budget_fraction} x one DP rank's pool)")
        index = None if self._queue else self._place(trajectory_id, reserve_tokens)
        if index is not None:
            self._grant(index, trajectory_id, reserve_tokens)
        else:
            waiter = _Waiter(trajectory_id, reserve_tokens, asyncio.get_running_loop().create_future())
            self._queue.append(waiter)
            self.max_queue = max(self.max_queue, len(self._queue))
            try:
                index = await waiter.future
            except asyncio.CancelledError:
                if waiter.future.done() and not waiter.future.cancelled():
                    self._release(waiter.future.result(), trajectory_id, reserve_tokens)  # granted, then cancelled
                else:
                    waiter.future.cancel()
                    self._dispatch()  # it may have been the head blocking others
                raise
        try:
            yield self.generators[index]
        finally:
            self._release(index, trajectory_id, reserve_tokens)


class RoundRobinScheduler(_Rotation):
    """Static placement: trajectory i goes to generator i mod N (skipping those out of rotation),
    with no admission control."""

    def __init__(self, generators: Sequence[Generator]):
        if not generators:
            raise ValueError("RoundRobinScheduler: generators must be non-empty")
        self.generators = list(generators)
        self._next = itertools.count()
        self.leases = [0] * len(self.generators)
        self.admitted = [0] * len(self.generators)
        self._init_rotation()

    def admitted_per_generator(self) -> list[int]:
        return list(self.admitted)

    @contextlib.asynccontextmanager
    async def lease(self, trajectory_id: str, reserve_tokens: int) -> AsyncIterator[Generator]:
        if len(self.down) == len(self.generators):
            raise self._no_generator_left()
        index = next(self._next) % len(self.generators)
        while index in self.down:
            index = next(self._next) % len(self.generators)
        self.leases[index] += 1
        self.admitted[index] += 1
        try:
            yield self.generators[index]
        finally:
            self.leases[index] -= 1
