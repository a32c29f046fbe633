"""Placing trajectories' turns on generators: KV-aware admission and routing, and a static baseline.

A trajectory opens a session for its life (`scheduler.trajectory(id, group=...)`) and asks it for a
generator turn by turn (`session.turn(context_tokens, max_new_tokens)`); between turns, while its
tool calls run, it holds no generator. `session.record(n)` tells the scheduler what a turn generated.

`KvScheduler` is the admission policy rStar2-Agent describes (§3.2; its release left it out): a new
trajectory starts on a generator only when that generator's KV budget (alpha x its pool, less the
larger of the ledger and what the generator reports in use) has room for it, and waits otherwise;
it starts as soon as room frees up.
- What the ledger holds is expected use, not the worst case. A turn reserves its context plus
  `new_token_ratio` x its expected output: the mean of the trajectory's own finished turns, or
  `INITIAL_NEW_TOKEN_RATIO` x its max_new_tokens before any (SGLang's `new_token_ratio` idea, per
  trajectory and updated as turns finish). Between turns, while its tool call runs, a trajectory
  holds no turn's reservation, only its context (cached there as a prefix, so it must not be evicted)
  plus its expected next turn. `reservation="worst-case"` reserves the whole remaining budget
  instead (the paper's rule, kept as a baseline).
- A started trajectory never waits: its next turn goes to the generator holding its prefix, unless
  that generator reports more KV in use than its budget (turns outgrew their estimates, or other
  clients use it) and another has room for the whole turn; then it moves there (rebalancing: its
  context is prefilled again). Otherwise a turn runs at home even past the budget: the engine's own
  admission and retraction absorb the excess.
- A new trajectory starts where its group's previous one started when it fits there, up to
  `group_block` in a row (the group's rollouts share their prompt's KV pages there; blocks, because
  the rollouts of one prompt tend to be long or short together, and one server holding a whole long
  group makes the step's tail), else on the least loaded generator (the largest share of its budget
  free, so that servers of different sizes get load in proportion). New
  trajectories start in arrival order: none overtakes another, so none starves.
- A generator's context length bounds what it can take (`Capacity.context_length` and
  `max_input_tokens`, from `/get_server_info`): a turn goes only where its context leaves room for a
  new token (a trajectory whose context outgrew its home moves), reserves no more output than the
  largest such room, and is refused (`ContextLengthExceeded`) when no generator in rotation takes it.
`reconcile()` reads what the generators report (`capacity()`: `/get_server_info` with `/v1/loads` or
`/get_load` for SGLang servers). A report is a snapshot: SGLang publishes `/v1/loads` every
`--load-snapshot-publish-interval` decode steps (and when it goes idle or stalls), so during a pause
or right after retractions it can still count tokens since freed. The scheduler takes it as a floor
under its own ledger, never as room: a stale report can only hold admission back, never overcommit a
generator, and while turns wait the scheduler reads the reports again at least every
WAITING_RECONCILE_S, so a stale (or foreign) report delays the queue by one interval at most.

`RoundRobinScheduler` assigns trajectory i to generator i mod N for all its turns, with no admission
control: the static policy the dynamic one is compared with.

Both take a failed generator out of rotation (`mark_down`, called by the rollout loop when a
generator is unavailable, or by `reconcile` when one cannot report): no turn goes to it afterwards,
and its trajectories continue elsewhere. When none is left, turns raise `GeneratorUnavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from typing import AsyncIterator, Hashable, Sequence

from rstar_jax.rollout.protocol import Capacity, ContextLengthExceeded, Generator, GeneratorUnavailable, RequestRejected

log = logging.getLogger(__name__)

RESERVATIONS = ("expected", "worst-case")
# A trajectory's first turn is expected to generate this share of its max_new_tokens (SGLang's
# SGLANG_INIT_NEW_TOKEN_RATIO); later turns as many tokens as its finished turns did on average.
INITIAL_NEW_TOKEN_RATIO = 0.7
# A turn reserves its context plus this share of its expected output: over its life a turn holds its
# context and, on average, part of its output, so reserving all of it would leave KV idle
# (benchmarks/rollout_sim.py measures the trade-off; retraction covers the turns that outgrow it).
NEW_TOKEN_RATIO = 0.65
GROUP_MEMORY = 4096  # groups whose placement is remembered
GROUP_BLOCK = 8
# Generators whose free shares of budget differ by less than this are equally loaded as far as the
# ledger can tell (it holds estimates); the one with fewer trajectories in progress is chosen.
BALANCE_TOLERANCE = 0.05
# While turns wait, the generators' reports are read at least this often (seconds): a stale or
# foreign report may hold the queue back, and nothing else may come along to read them again.
WAITING_RECONCILE_S = 1.0


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

    def _live_indices(self) -> list[int]:
        return [i for i in range(len(self.generators)) if i not in self.down]

    def mark_down(self, generator: Generator, reason: str) -> None:
        """Takes `generator` out of rotation (idempotent); new turns go to the others. A generator this
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

    def stats(self) -> dict[str, float]:
        """The step's figures for the metrics (`scheduler/<name>`): turns admitted per generator and
        how many generators left the rotation."""
        admitted = {f"admitted_{i}": n for i, n in enumerate(self.admitted_per_generator())}
        return {**admitted, "generators_down": len(self.down)}

    def _no_generator_left(self) -> GeneratorUnavailable:
        reasons = "; ".join(f"{getattr(self.generators[i], 'name', i)}: {r}" for i, r in self.down.items())
        return GeneratorUnavailable(f"every generator is out of rotation ({reasons})")


@dataclasses.dataclass
class GeneratorLedger:
    """The scheduler's view of one generator, in tokens."""

    capacity: int  # C_s: the generator's KV pool (max_total_num_tokens summed over its DP ranks)
    ranks: int = 1  # DP ranks: one request lives in one rank's pool, capacity / ranks
    reserved: int = 0  # R_s: running turns' reservations plus what trajectories between turns claim
    parked: int = 0  # the part of `reserved` that trajectories between turns hold (prefix + next turn)
    reported_used: int = 0  # what the generator last reported in use (reconcile)
    running: int = 0  # turns running here now
    active: int = 0  # trajectories started here and not finished (or moved away)
    peak_reserved: int = 0
    admitted: int = 0  # trajectories whose first turn ran here
    moved_in: int = 0  # turns of trajectories whose prefix was on another generator (rebalancing)
    limits: Capacity | None = None  # its per-request context limits, as last reported

    def admits(self, context: int) -> bool:
        """Whether a request with this context can run here at all (room for one new token)."""
        room = None if self.limits is None else self.limits.room_for(context)
        return room is None or room >= 1


@dataclasses.dataclass
class _TurnStats:
    """Finished turns and the tokens they generated."""

    turns: int = 0
    tokens: int = 0

    def add(self, tokens: int) -> None:
        self.turns += 1
        self.tokens += tokens

    def mean(self) -> float | None:
        return self.tokens / self.turns if self.turns else None


@dataclasses.dataclass
class _Trajectory:
    tid: str
    group: Hashable | None
    home: int | None = None  # the generator holding its prefix
    parked: int = 0  # tokens claimed at home between turns: its context and expected next turn
    stats: _TurnStats = dataclasses.field(default_factory=_TurnStats)
    turn: "_Turn | None" = None  # the turn in flight (placed or waiting)
    owner: int | None = None  # the generator whose `active` count it is in (None: not started)


@dataclasses.dataclass
class _Turn:
    trajectory: _Trajectory
    context: int
    max_new: int
    future: asyncio.Future
    index: int | None = None  # where it runs, once granted
    reserved: int = 0  # what it holds there
    generated: int | None = None  # recorded by the caller
    complete: bool = True


class _KvSession:
    """One trajectory's handle on a KvScheduler (see `KvScheduler.trajectory`)."""

    def __init__(self, scheduler: "KvScheduler", trajectory: _Trajectory):
        self._scheduler = scheduler
        self._trajectory = trajectory

    @contextlib.asynccontextmanager
    async def turn(self, context_tokens: int, max_new_tokens: int) -> AsyncIterator[Generator]:
        """Waits for a generator with room for this turn and holds its reservation until the turn ends."""
        turn = await self._scheduler._acquire(self._trajectory, int(context_tokens), int(max_new_tokens))
        try:
            yield self._scheduler.generators[turn.index]
        finally:
            self._scheduler._end_turn(turn)

    def record(self, generated_tokens: int, *, complete: bool = True) -> None:
        """What the current turn generated; `complete=False` for a turn cut short (an abort), whose
        length says nothing about the next turn's."""
        turn = self._trajectory.turn
        if turn is None:
            raise RuntimeError(f"record: trajectory {self._trajectory.tid!r} has no turn in flight")
        turn.generated, turn.complete = int(generated_tokens), complete


class KvScheduler(_Rotation):
    """KV-aware admission and routing over generators; implements `rstar_jax.rollout.protocol.Scheduler`.

    budget_fraction (alpha): the share of each generator's capacity that reservations may fill.
    reservation: "expected" (a turn reserves its context plus the expected output) or "worst-case"
    (its context plus its whole max_new_tokens).
    capacities: per-generator capacity in tokens; read from `generator.capacity()` when omitted.
    reconcile_interval: seconds between automatic `reconcile()` calls made while placing turns
    (None: only explicit calls and the first turn).
    """

    def __init__(self, generators: Sequence[Generator], *, budget_fraction: float = 1.0,
                 reservation: str = "expected", new_token_ratio: float = NEW_TOKEN_RATIO, group_block: int = GROUP_BLOCK,
                 capacities: Sequence[int] | None = None, reconcile_interval: float | None = None):
        if not generators:
            raise ValueError("KvScheduler: generators must be non-empty")
        if not 0.0 < budget_fraction <= 1.0:
            raise ValueError(f"KvScheduler: budget_fraction must be in (0, 1], got {budget_fraction}")
        if reservation not in RESERVATIONS:
            raise ValueError(f"KvScheduler: reservation must be one of {RESERVATIONS}, got {reservation!r}")
        if not 0.0 < new_token_ratio <= 1.0:
            raise ValueError(f"KvScheduler: new_token_ratio must be in (0, 1], got {new_token_ratio}")
        if group_block < 1:
            raise ValueError(f"KvScheduler: group_block must be >= 1, got {group_block}")
        if capacities is not None and len(capacities) != len(generators):
            raise ValueError(f"KvScheduler: {len(capacities)} capacities for {len(generators)} generators")
        self.generators = list(generators)
        self.budget_fraction = budget_fraction
        self.reservation = reservation
        self.new_token_ratio = new_token_ratio
        self.group_block = group_block
        self.reconcile_interval = reconcile_interval
        self._ledgers: list[GeneratorLedger] | None = (
            None if capacities is None else [GeneratorLedger(int(c)) for c in capacities])
        self._trajectories: dict[str, _Trajectory] = {}
        self._fresh: collections.deque[_Turn] = collections.deque()  # new trajectories waiting to start
        self._waiting = 0
        # group -> [generator its latest members started on, how many started there in a row]
        self._group_home: collections.OrderedDict[Hashable, list[int]] = collections.OrderedDict()
        self._last_reconcile = 0.0
        self._init_lock = asyncio.Lock()
        self._refresher: asyncio.Task | None = None  # reconciles while turns wait
        self.admitted = 0  # trajectories placed so far
        self.turns = 0  # turns placed so far
        self.moves = 0  # turns placed away from the generator holding their prefix
        self.max_queue = 0
        self._init_rotation()

    def stats(self) -> dict[str, float]:
        """Beside the rotation's figures: turns placed away from their prefix's generator, and the
        longest queue of turns waiting for KV room."""
        return {**super().stats(), "moves": self.moves, "max_queue": self.max_queue}

    def admitted_per_generator(self) -> list[int]:
        """Trajectories whose first turn ran on each generator so far (for load metrics)."""
        return [ledger.admitted for ledger in self._ledgers or []]

    # -- ledger -------------------------------------------------------------------------------
    @property
    def ledgers(self) -> list[GeneratorLedger]:
        if self._ledgers is None:
            raise RuntimeError("KvScheduler: capacities are not known yet (call reconcile() or place a turn first)")
        return self._ledgers

    def budget(self, index: int) -> int:
        """alpha * C_s: the most a generator's reservations may add up to."""
        return int(self.budget_fraction * self.ledgers[index].capacity)

    def largest_request(self, index: int) -> int:
        """The most one turn may reserve here: its share alpha of one DP rank's pool."""
        ledger = self.ledgers[index]
        return int(self.budget_fraction * ledger.capacity) // max(1, ledger.ranks)

    def free(self, index: int) -> int:
        """Free budget: alpha * C_s minus the larger of the ledger and the generator's own report."""
        ledger = self.ledgers[index]
        return self.budget(index) - max(ledger.reserved, ledger.reported_used)

    @property
    def queued(self) -> int:
        """Turns waiting for room."""
        return self._waiting

    def estimate(self, trajectory_id: str, max_new_tokens: int) -> int:
        """The tokens a turn of `trajectory_id` is expected to generate (what it reserves beyond its context)."""
        return self._estimate(self._trajectories.get(trajectory_id), max_new_tokens)

    def _estimate(self, trajectory: _Trajectory | None, max_new: int) -> int:
        if self.reservation == "worst-case":
            return max_new
        mean = trajectory.stats.mean() if trajectory is not None else None
        expected = INITIAL_NEW_TOKEN_RATIO * max_new if mean is None else mean
        return max(1, min(max_new, math.ceil(self.new_token_ratio * expected)))

    def _footprint(self, turn: _Turn) -> int:
        """What a turn reserves: its context and its expected output, estimated when it is placed
        (what has been learnt while it waited counts)."""
        return turn.context + self._estimate(turn.trajectory, turn.max_new)

    async def reconcile(self) -> None:
        """Reads every generator's capacity and usage; tokens in use beyond the ledger (other
        clients, turns longer than expected, a smaller pool than assumed) count as occupied. A
        generator that is unavailable leaves the rotation. Then places waiting turns."""
        live = self._live_indices()
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
                self._ledgers[i].limits = report
        self._last_reconcile = time.monotonic()
        self._after_down()

    async def _maybe_reconcile(self) -> None:
        async with self._init_lock:
            due = self.reconcile_interval is not None and (
                time.monotonic() - self._last_reconcile >= self.reconcile_interval)
            if self._ledgers is None or due:
                await self.reconcile()

    async def _refresh_while_waiting(self) -> None:
        """Re-reads the generators' reports while turns wait (every `reconcile_interval`, at least
        every WAITING_RECONCILE_S): a report that still counts freed tokens (a load snapshot taken
        before requests finished, retracted or were aborted by a pause) then holds admission back for
        one interval at most, even when no turn of this scheduler ends meanwhile."""
        interval = min(self.reconcile_interval or WAITING_RECONCILE_S, WAITING_RECONCILE_S)
        while self._waiting > 0:
            await asyncio.sleep(interval)
            if self._waiting == 0:
                return
            try:
                async with self._init_lock:
                    await self.reconcile()
            except Exception as e:  # noqa: BLE001  (a bad report must not end the refresher; turns still wait)
                log.warning("reconcile while turns wait failed: %s", e)

    # -- sessions -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def trajectory(self, trajectory_id: str, *, group: Hashable | None = None) -> AsyncIterator[_KvSession]:
        """A trajectory's session: its turns share a home generator, and its parked prefix is
        released when the session ends. `group` (e.g. the prompt's index) co-locates a group's
        first turns."""
        if trajectory_id in self._trajectories:
            raise ValueError(f"trajectory: {trajectory_id!r} already has a session")
        trajectory = _Trajectory(trajectory_id, group)
        self._trajectories[trajectory_id] = trajectory
        try:
            yield _KvSession(self, trajectory)
        finally:
            del self._trajectories[trajectory_id]
            if trajectory.home is not None and self._ledgers is not None:
                self._unpark(trajectory)
            if trajectory.owner is not None:
                self.ledgers[trajectory.owner].active -= 1
            self._dispatch()

    async def _acquire(self, trajectory: _Trajectory, context: int, max_new: int) -> _Turn:
        if context < 1 or max_new < 1:
            raise ValueError(f"turn: context_tokens ({context}) and max_new_tokens ({max_new}) must be >= 1 "
                             f"for {trajectory.tid!r}")
        if trajectory.turn is not None:
            raise ValueError(f"turn: trajectory {trajectory.tid!r} already has a turn in flight")
        await self._maybe_reconcile()
        live = self._live_indices()
        if not live:
            raise self._no_generator_left()
        max_new = self._check_fits_somewhere(trajectory.tid, context, max_new, live)
        turn = _Turn(trajectory, context, max_new, asyncio.get_running_loop().create_future())
        trajectory.turn = turn
        if trajectory.home is not None and trajectory.home not in self.down:
            self._grant(turn, self._continue_on(turn))  # a started trajectory never waits
            return turn
        trajectory.home, trajectory.parked = None, 0  # new, or its generator left the rotation with its prefix
        self._fresh.append(turn)
        self._waiting += 1
        self.max_queue = max(self.max_queue, self._waiting)
        self._dispatch()
        if not turn.future.done() and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_while_waiting())
        try:
            await turn.future
        except BaseException:
            if turn.index is not None:
                self._end_turn(turn)  # granted, then cancelled before the caller saw it
            else:
                trajectory.turn = None
                if not turn.future.done() or turn.future.cancelled():  # not failed by the scheduler
                    turn.future.cancel()  # it leaves the queue (dropped lazily)
                    self._waiting -= 1
                    self._dispatch()  # it may have been the head blocking others
            raise
        return turn

    def _check_fits_somewhere(self, tid: str, context: int, max_new: int, live: list[int]) -> int:
        """Refuses a turn no generator in rotation can run; returns its max_new_tokens within the
        largest context length among those that can (what the generator will ask for)."""
        rank_pool = max(self.ledgers[i].capacity // self.ledgers[i].ranks for i in live)
        if context >= rank_pool:
            raise RequestRejected(f"trajectory {tid!r}: a context of {context} tokens does not fit any generator "
                                  f"in rotation (the largest pool of one DP rank holds {rank_pool})")
        admitting = [i for i in live if self.ledgers[i].admits(context)]
        if not admitting:
            lengths = sorted({self.ledgers[i].limits.context_length for i in live} - {None})
            raise ContextLengthExceeded(f"trajectory {tid!r}: a context of {context} tokens leaves no room for a "
                                        f"new token on any generator in rotation (context lengths {lengths})")
        rooms = [self.ledgers[i].limits.room_for(context) if self.ledgers[i].limits else None for i in admitting]
        return max_new if None in rooms else min(max_new, max(rooms))

    def _end_turn(self, turn: _Turn) -> None:
        trajectory, index = turn.trajectory, turn.index
        trajectory.turn = None
        ledger = self.ledgers[index]
        ledger.reserved -= turn.reserved
        ledger.running -= 1
        if turn.generated is not None and turn.complete:
            trajectory.stats.add(turn.generated)
        if index not in self.down and turn.generated is not None:
            trajectory.home = index
            # Its KV stays cached there, and its next turn is expected: both stay claimed, so new
            # trajectories are started only where those already started can go on.
            context = turn.context + turn.generated
            trajectory.parked = context + self._estimate(trajectory, max(1, turn.max_new - turn.generated))
            ledger.reserved += trajectory.parked
            ledger.parked += trajectory.parked
        else:
            trajectory.home, trajectory.parked = None, 0  # a failed or abandoned turn left no usable prefix
        self._dispatch()

    def _unpark(self, trajectory: _Trajectory) -> None:
        ledger = self.ledgers[trajectory.home]
        ledger.reserved -= trajectory.parked
        ledger.parked -= trajectory.parked
        trajectory.parked = 0

    # -- placement ----------------------------------------------------------------------------
    def _fits(self, index: int, tokens: int) -> bool:
        """Whether a turn reserving `tokens` fits the free budget (one larger than a rank's share
        fits a generator with nothing reserved)."""
        return self.free(index) >= min(tokens, self.largest_request(index))

    def _freest(self, exclude: int | None = None, context: int = 0) -> int | None:
        """The least loaded generator: the largest share of its budget free, so that load follows
        each generator's size (a larger pool also brings more compute: more GPUs, or larger ones).
        Among those within BALANCE_TOLERANCE of it, the one with the fewest trajectories in progress
        per token of budget: the ledger's estimates cannot tell such generators apart, their counts can.
        Only generators whose context length takes `context` are candidates."""
        live = [i for i in self._live_indices() if i != exclude and self.ledgers[i].admits(context)]
        if not live:
            return None
        share = {i: self.free(i) / max(1, self.budget(i)) for i in live}
        best = max(share.values())
        return min((i for i in live if share[i] >= best - BALANCE_TOLERANCE),
                   key=lambda i: (self.ledgers[i].active / max(1, self.budget(i)), i))

    def _continue_on(self, turn: _Turn) -> int:
        """Where a started trajectory's turn runs: its home, which holds its prefix, unless the home
        reports more KV in use than its budget (turns outgrew their estimates, or other clients use
        it) and another generator has room for the whole turn: then it moves there (rebalancing; its
        context is prefilled again there). The ledger alone does not move a turn: it counts expected
        use, and a move costs a whole prefill. An overloaded home with nowhere to move to runs the
        turn anyway: the engine's own admission and retraction handle the excess. A context grown past
        the home's context length moves to a generator that takes it, room or not."""
        home = turn.trajectory.home
        if not self.ledgers[home].admits(turn.context):
            return self._freest(exclude=home, context=turn.context)  # _check_fits_somewhere found one
        if self.ledgers[home].reported_used <= self.budget(home):
            return home
        target = self._freest(exclude=home, context=turn.context)
        return target if target is not None and self._fits(target, self._footprint(turn)) else home

    def _grant(self, turn: _Turn, index: int, reserve: int | None = None) -> None:
        """Places `turn` on generator `index`, reserving `reserve` tokens (default: its footprint)."""
        trajectory = turn.trajectory
        ledger = self.ledgers[index]
        if trajectory.home is not None:  # its parked claim becomes this turn's reservation, or is given up
            if trajectory.home != index:
                self.moves += 1
                ledger.moved_in += 1
            self._unpark(trajectory)
            trajectory.home = None
        else:
            self._waiting -= 1  # it waited in the queue
        if trajectory.owner is None:  # its first turn: the trajectory starts here
            self.admitted += 1
            ledger.admitted += 1
            if trajectory.group is not None:
                home = self._group_home.get(trajectory.group)
                if home is not None and home[0] == index:
                    home[1] += 1
                else:
                    self._group_home[trajectory.group] = [index, 1]
                    while len(self._group_home) > GROUP_MEMORY:
                        self._group_home.popitem(last=False)
        if trajectory.owner != index:
            if trajectory.owner is not None:
                self.ledgers[trajectory.owner].active -= 1
            trajectory.owner = index
            ledger.active += 1
        turn.index, turn.reserved = index, self._footprint(turn) if reserve is None else reserve
        ledger.reserved += turn.reserved
        ledger.running += 1
        ledger.peak_reserved = max(ledger.peak_reserved, ledger.reserved)
        self.turns += 1
        turn.future.set_result(index)

    @staticmethod
    def _head(queue: collections.deque) -> _Turn | None:
        """The first turn of `queue` still waiting (those cancelled meanwhile are dropped)."""
        while queue and queue[0].future.done():
            queue.popleft()
        return queue[0] if queue else None

    def _dispatch(self) -> None:
        """Starts waiting trajectories in arrival order while their first turns fit: on their
        group's generator when it has room (the group's prompt is cached there), else on the freest."""
        if self._ledgers is None:
            return
        while (turn := self._head(self._fresh)) is not None:
            live = self._live_indices()
            if live and not any(self.ledgers[i].admits(turn.context) for i in live):
                self._fresh.popleft()  # those that took its context left the rotation
                self._waiting -= 1
                turn.future.set_exception(ContextLengthExceeded(
                    f"trajectory {turn.trajectory.tid!r}: no generator left in rotation takes a context of "
                    f"{turn.context} tokens"))
                continue
            full = self._footprint(turn)
            home = self._group_home.get(turn.trajectory.group)
            if (home is not None and home[1] < self.group_block and home[0] not in self.down
                    and self.ledgers[home[0]].admits(turn.context) and self._fits(home[0], full)):
                target = home[0]
            else:
                target = self._freest(context=turn.context)
                if target is None or not self._fits(target, full):
                    return  # first come, first served: nothing overtakes the head of the queue
            self._fresh.popleft()
            self._grant(turn, target, full)

    def _after_down(self) -> None:
        """Waiting turns fail when no generator is left, or are placed on those left."""
        if self._ledgers is None:
            return
        if not self._live_indices():
            waiting, self._fresh = list(self._fresh), collections.deque()
            for turn in waiting:
                if not turn.future.done():
                    self._waiting -= 1
                    turn.future.set_exception(self._no_generator_left())
            return
        self._dispatch()


class _FixedSession:
    """A trajectory pinned to one generator (round-robin), re-pinned when that one leaves the rotation."""

    def __init__(self, scheduler: "RoundRobinScheduler", index: int):
        self._scheduler = scheduler
        self.index = index

    @contextlib.asynccontextmanager
    async def turn(self, context_tokens: int, max_new_tokens: int) -> AsyncIterator[Generator]:
        scheduler = self._scheduler
        if self.index in scheduler.down:
            self.index = scheduler._next_index()
        scheduler.leases[self.index] += 1
        try:
            yield scheduler.generators[self.index]
        finally:
            scheduler.leases[self.index] -= 1

    def record(self, generated_tokens: int, *, complete: bool = True) -> None:
        pass  # static placement learns nothing


class RoundRobinScheduler(_Rotation):
    """Static placement: trajectory i goes to generator i mod N (skipping those out of rotation) for
    all its turns, with no admission control."""

    def __init__(self, generators: Sequence[Generator]):
        if not generators:
            raise ValueError("RoundRobinScheduler: generators must be non-empty")
        self.generators = list(generators)
        self._next = itertools.count()
        self.leases = [0] * len(self.generators)  # turns running on each generator
        self.admitted = [0] * len(self.generators)
        self._init_rotation()

    def admitted_per_generator(self) -> list[int]:
        return list(self.admitted)

    def _next_index(self) -> int:
        if len(self.down) == len(self.generators):
            raise self._no_generator_left()
        index = next(self._next) % len(self.generators)
        while index in self.down:
            index = next(self._next) % len(self.generators)
        return index

    @contextlib.asynccontextmanager
    async def trajectory(self, trajectory_id: str, *, group: Hashable | None = None) -> AsyncIterator[_FixedSession]:
        index = self._next_index()
        self.admitted[index] += 1
        yield _FixedSession(self, index)


class DirectSession:
    """Every turn on one generator (no scheduler): the session `run_trajectory` uses with a bare generator."""

    def __init__(self, generator: Generator):
        self.generator = generator

    @contextlib.asynccontextmanager
    async def turn(self, context_tokens: int, max_new_tokens: int) -> AsyncIterator[Generator]:
        yield self.generator

    def record(self, generated_tokens: int, *, complete: bool = True) -> None:
        pass
