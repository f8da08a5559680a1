"""Fair turns on one worker's loop: whose CPU stage runs next, and how many of one org's run at once.

The loop runs one synchronous stage at a time (decoding a request, the pipeline after retrieval);
a stage cannot be interrupted, so what can be chosen is which waiting stage starts next. First in,
first out lets one org's heavy requests run back to back in front of everyone else's. Here each
org has its own queue and the next stage comes from the org that has used the least of this
loop's CPU lately (measured stage time, decaying with ``half_life_s``); within an org, the oldest
first. A light request of one org therefore waits for at most the stage that is running, not for
every heavy stage queued before it.

``slot`` bounds the assemblies of one org in flight in this worker (``IBEX_WORKER_ORG_CONCURRENCY``;
0: no bound below the worker's credit). Waiting for a slot or a turn ends at the request's
deadline with ``DeadlineExceeded``, the error expired work gets before it starts.

When a stage ends, the next turn is granted a few loop iterations later, not at once: the requests
whose frames or answers arrived during the stage could not run while it did, and queue by then.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..shared.wire.errors import DeadlineExceeded

GRANT_HOPS = 3  # loop iterations between a stage's end and the next grant (I/O is polled in each)


@dataclass(slots=True)
class _Usage:
    ns: float = 0.0
    stamp_ns: int = 0

    def now(self, now_ns: int, half_life_ns: float) -> float:
        return self.ns * math.exp2(-(now_ns - self.stamp_ns) / half_life_ns)


@dataclass(slots=True)
class _Org:
    usage: _Usage = field(default_factory=_Usage)
    turns: deque[asyncio.Future[None]] = field(default_factory=deque)
    slots: deque[asyncio.Future[None]] = field(default_factory=deque)
    running: int = 0


class FairTurns:
    """One worker's CPU turns and per-org slots (see the module docstring)."""

    def __init__(self, *, per_org: int = 0, half_life_s: float = 1.0) -> None:
        self.per_org = per_org
        self.half_life_ns = half_life_s * 1e9
        self.orgs: dict[str, _Org] = {}
        self.busy = False  # a turn is held, or reserved for the next grant
        # The loop's time in turns so far (ns): what retrieval's limits give back (worker.patience).
        self.busy_ns = 0
        self.stats: dict[str, int] = {"turn_waits": 0, "slot_waits": 0, "expired_waiting": 0}

    def _org(self, org: str) -> _Org:
        found = self.orgs.get(org)
        if found is None:
            found = self.orgs[org] = _Org()
        return found

    @asynccontextmanager
    async def slot(self, org: str, deadline_ns: int) -> AsyncIterator[None]:
        """One of ``per_org`` places for an assembly of ``org``; waits (until the deadline) when all are taken."""
        state = self._org(org)
        if self.per_org and (state.running >= self.per_org or state.slots):
            self.stats["slot_waits"] += 1
            await self._wait(state.slots, deadline_ns, "a place among its org's assemblies")  # taken for us
        else:
            state.running += 1
        try:
            yield
        finally:
            state.running -= 1
            self._pass_slot(org, state)

    def _pass_slot(self, org: str, state: _Org) -> None:
        while state.slots and (self.per_org == 0 or state.running < self.per_org):
            waiter = state.slots.popleft()
            if not waiter.done():
                waiter.set_result(None)
                state.running += 1  # taken on the waiter's behalf; it gives it back in its own finally
                return
        self._forget(org, state)

    @asynccontextmanager
    async def turn(self, org: str, deadline_ns: int) -> AsyncIterator[None]:
        """The loop's CPU for one synchronous stage of ``org``'s request."""
        state = self._org(org)
        if self.busy:
            self.stats["turn_waits"] += 1
            await self._wait(state.turns, deadline_ns, "its turn on the worker's CPU")
        else:
            self.busy = True
        start = time.monotonic_ns()
        try:
            yield
        finally:
            end = time.monotonic_ns()
            self.busy_ns += end - start
            state.usage.ns = state.usage.now(end, self.half_life_ns) + (end - start)
            state.usage.stamp_ns = end
            self._after_turn()

    async def _wait(self, queue: deque[asyncio.Future[None]], deadline_ns: int, what: str) -> None:
        """Queue a future and wait for it; ``DeadlineExceeded`` when the deadline comes first. A
        waiter granted just as it was cancelled passes what it was given on."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        queue.append(waiter)
        timer = loop.call_later(max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9), _expire, waiter, what)
        try:
            await waiter
        except DeadlineExceeded:
            self.stats["expired_waiting"] += 1
            raise
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(queue)
            raise
        finally:
            timer.cancel()

    def _give_back(self, queue: deque[asyncio.Future[None]]) -> None:
        for org, state in self.orgs.items():
            if queue is state.slots:
                state.running -= 1
                self._pass_slot(org, state)
                return
        self._after_turn()

    def _after_turn(self) -> None:
        """The stage is over: the turn stays reserved for ``GRANT_HOPS`` iterations, so the tasks
        that became ready during the stage (they could not run while it did) queue for it, then it
        goes to the fairest of them (or is free when none came)."""
        self.busy = True
        _later(asyncio.get_running_loop(), GRANT_HOPS, self._grant)

    def _grant(self) -> None:
        """Hand the turn to the oldest live waiter of the org that has used the least CPU lately."""
        now = time.monotonic_ns()
        while True:
            waiting = [(state.usage.now(now, self.half_life_ns), org)
                       for org, state in self.orgs.items() if state.turns]
            if not waiting:
                self.busy = False
                return
            _, org = min(waiting)
            state = self.orgs[org]
            waiter = state.turns.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
            self._forget(org, state)

    def _forget(self, org: str, state: _Org) -> None:
        """Drop an org's entry once nothing of it is queued or running and its usage has decayed."""
        if not state.turns and not state.slots and state.running == 0 and \
                state.usage.now(time.monotonic_ns(), self.half_life_ns) < 1_000:
            self.orgs.pop(org, None)

    def sweep(self) -> None:
        """Forget idle orgs (called from the heartbeat): the table holds only orgs seen lately."""
        for org, state in list(self.orgs.items()):
            self._forget(org, state)


def _expire(waiter: asyncio.Future[None], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(DeadlineExceeded(f"deadline passed while the request waited for {what}"))


def _later(loop: asyncio.AbstractEventLoop, hops: int, callback: Callable[[], None]) -> None:
    """Run ``callback`` after ``hops`` further loop iterations."""
    if hops <= 0:
        callback()
    else:
        loop.call_soon(_later, loop, hops - 1, callback)
