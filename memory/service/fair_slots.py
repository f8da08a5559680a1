"""The memory service's searches computed at once, shared by orgs in fair order.

A search's CPU runs on the service's one event loop, interleaved step by step with every other
search in it: with ``n`` in flight each takes about ``n`` times its own CPU time. A cap per org
alone (``IBEX_MEMORY_MAX_CONCURRENT_PER_ORG``) leaves a flooding org its whole cap beside one
call of another org, which then runs several times slower than alone and misses its caller's
deadline. So searches also hold one of ``IBEX_MEMORY_MAX_CONCURRENT`` slots for all orgs; a
freed slot goes to the waiting org with the fewest searches in for its weight
(``IBEX_MEMORY_ORG_WEIGHTS``), the longest waiting first among equals. An org alone uses every
slot (work-conserving); an org under its share waits for at most one search to end, whatever
another org has queued.

A slot is taken once the question's vector is known: the embedding has its own fair queue and
lanes (``memory.service.querybatch``), and a slot held through a flooding org's wait for its
embedding would keep every other org's search waiting behind that wait.

Only searches hold slots. The hot list ranked for a question holds none: its own work is a
cosine over at most ``HOT_LIMIT_MAX`` stored vectors, and its question's embedding is the query
batcher's (``memory.service.querybatch``, fair by org and refused when late), computed once for
it and the same assembly's search. Were it to take a slot too, an assembly would need both slots
while a flood holds one, and the victim's hot call would be refused for the wait.

No call waits for a slot it cannot use: once hold times are measured, a call whose expected wait
(its org's calls queued ahead of it at its org's share of the slots, or the first slot to free
when none are) and a hold after it would end past its caller's deadline is refused at once with a
503 (``AtCapacity``), the overload signal a caller's admission learns from, instead of a 504 when
its deadline passes in the queue. An org over its share has the most queued, so its calls are the
ones refused. A call still waiting at its deadline is answered 504 (``DeadlinePassed``).

Pure bookkeeping on the event loop: no threads, no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from .deadline import DeadlinePassed
from .http import ApiError
from .querybatch import smoothed

EWMA = 0.1  # weight of one hold in the measured hold time
MIN_HOLDS = 20  # holds measured before a call is refused on its expected wait


class AtCapacity(ApiError):
    """The call's wait for a slot and its own hold would end after its caller's deadline (503)."""

    def __init__(self, late_ms: float) -> None:
        super().__init__(503, f"the memory service is at capacity: this org's searches queued ahead would end this "
                              f"one {late_ms:.1f} ms after the caller's deadline (Ibex-Timeout-Ms)")


class FairSlots:
    """``total`` slots for all orgs, at most ``per_org`` of them held by one org (module doc)."""

    def __init__(self, total: int, per_org: int, weights: Mapping[str, float] | None = None) -> None:
        self.total = total
        self.per_org = per_org
        self._weights = dict(weights or {})
        self._held: dict[str, int] = {}
        self._busy = 0
        self._waiting: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}
        self._seq = itertools.count()
        self.waited = 0  # calls that found no slot for them and queued
        self.timed_out = 0  # calls whose deadline passed while they queued
        self.refused = 0  # calls refused on arrival: their wait and hold would end past their deadline
        self.hold_s = 0.0  # measured time a call holds its slot
        self.holds = 0

    @property
    def busy(self) -> int:
        return self._busy

    def held(self, org: str) -> int:
        return self._held.get(org, 0)

    def _take(self, org: str) -> None:
        self._busy += 1
        self._held[org] = self._held.get(org, 0) + 1

    def _release(self, org: str) -> None:
        self._busy -= 1
        n = self._held[org] - 1
        if n:
            self._held[org] = n
        else:
            del self._held[org]
        self._grant()

    def _grant(self) -> None:
        """Free slots to waiting calls, fewest held for their weight first."""
        while self._busy < self.total:
            best: tuple[float, int, str] | None = None
            for org, queue in self._waiting.items():
                while queue and queue[0][1].done():  # gone while waiting (deadline, cancelled)
                    queue.popleft()
                if queue and self.held(org) < self.per_org:
                    key = (self.held(org) / self._weights.get(org, 1.0), queue[0][0], org)
                    if best is None or key < best:
                        best = key
            if best is None:
                self._waiting = {o: q for o, q in self._waiting.items() if q}
                return
            org = best[2]
            queue = self._waiting[org]
            _, fut = queue.popleft()
            if not queue:
                del self._waiting[org]
            self._take(org)
            fut.set_result(None)

    def expected_wait(self, org: str) -> float:
        """Seconds until a call of ``org`` arriving now would have its slot (module doc): behind
        its org's queue at the org's share of the slots, after the first slot to free (of
        ``total`` held for ``hold_s`` each, about ``hold_s / (total + 1)`` on average)."""
        ahead = len(self._waiting.get(org, ()))
        active = set(self._held) | {o for o, q in self._waiting.items() if q} | {org}
        share = self._weights.get(org, 1.0) / sum(self._weights.get(o, 1.0) for o in active)
        slots = min(float(self.per_org), self.total * share)
        return self.hold_s * (ahead / slots + 1.0 / (self.total + 1))

    @asynccontextmanager
    async def hold(self, org: str, deadline: float | None = None) -> AsyncIterator[None]:
        """One slot for ``org`` while inside; ``deadline`` (``time.monotonic``, the event loop's
        clock) bounds the wait for it, and refuses it at once when it cannot be met."""
        if self._busy < self.total and self.held(org) < self.per_org and not self._waiting.get(org):
            self._take(org)
        else:
            if deadline is not None and self.holds >= MIN_HOLDS:
                late = time.monotonic() + self.expected_wait(org) + self.hold_s - deadline
                if late > 0:
                    self.refused += 1
                    raise AtCapacity(late * 1000.0)
            await self._wait(org, deadline)
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started
            self.holds += 1
            self.hold_s = smoothed(self.hold_s, took, EWMA) if self.holds > 1 else took
            self._release(org)

    async def _wait(self, org: str, deadline: float | None) -> None:
        self.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(org, collections.deque()).append((next(self._seq), fut))
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():  # granted as it gave up: the slot goes back
                self._release(org)
            else:
                fut.cancel()
            if isinstance(exc, TimeoutError):
                self.timed_out += 1
                raise DeadlinePassed("its turn among the searches in flight") from None
            raise
