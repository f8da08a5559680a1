"""The memory service's searches computed at once, shared by orgs in fair order.

A search's CPU runs on the service's one event loop, interleaved step by step with every other
search in it: with ``n`` in flight each takes about ``n`` times its own CPU time. A cap per org
alone (``IBEX_MEMORY_MAX_CONCURRENT_PER_ORG``) leaves a flooding org its whole cap beside one
call of another org, which then runs several times slower than alone and misses its caller's
deadline. So searches also hold one of ``IBEX_MEMORY_MAX_CONCURRENT`` slots for all orgs; a
freed slot goes to the waiting org with the fewest searches in for its weight
(``IBEX_MEMORY_ORG_WEIGHTS``), the longest waiting first among equals. An org alone uses every
slot (work-conserving); an org under its share waits for at most one search to end, whatever
another org has queued. A call still waiting at its caller's deadline is answered 504
(``DeadlinePassed``), as every stage that would start too late is.

Pure bookkeeping on the event loop: no threads, no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from .deadline import DeadlinePassed


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

    @asynccontextmanager
    async def hold(self, org: str, deadline: float | None = None) -> AsyncIterator[None]:
        """One slot for ``org`` while inside; ``deadline`` (``time.monotonic``, the event loop's
        clock) bounds the wait for it."""
        if self._busy < self.total and self.held(org) < self.per_org and not self._waiting.get(org):
            self._take(org)
        else:
            await self._wait(org, deadline)
        try:
            yield
        finally:
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
