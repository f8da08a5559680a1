"""The broker's queue, shared fairly among orgs: one FIFO per org, dispatched by weighted fair
queueing (docs/architecture.md "Admission control").

Pure bookkeeping, no clock and no sockets. Dispatch order is start-time fair queueing (Goyal et
al.) with every request costing one: each org with work has a virtual start tag for the request at
its head; the next request dispatched is the head of the org with the lowest tag, which then
advances by ``1 / weight``. An org that had no work joins at the current virtual time (the tag of
the last request dispatched), so time it spent idle is not banked, and it is never placed behind
the backlog of the orgs already waiting: its first request goes at the next free slot. The queue
is work-conserving: an org alone is dispatched whenever a slot is free.

Costs: ``push``, ``pop`` and ``remove`` are O(log orgs with work) (one heap per operation, with
no scan over orgs or requests); a request answered while it waits (expired) is forgotten lazily,
so removing it is O(1) and an org's FIFO is compacted when it holds more dead entries than live.
``push_out`` (only when the whole queue is full) finds the org most over its share from a second,
lazily pruned heap.

Items only need to be hashable; two equal items are interchangeable (the broker's items are
request keys, and a key names one pending request at a time).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Container, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

COMPACT_SLACK = 32  # dead entries an org's FIFO may hold beyond its live ones before it is rebuilt
IDLE_CAP = 1024  # idle orgs' finish times kept before those the virtual time has passed are dropped


@dataclass(slots=True)
class OrgQueue(Generic[T]):
    """One org's FIFO and its place in the fair order."""

    weight: float
    items: collections.deque[T] = field(default_factory=collections.deque)
    live: int = 0  # items still waiting; the rest of ``items`` are dead (``dead`` counts them)
    dead: collections.Counter[T] = field(default_factory=collections.Counter)
    tag: float = 0.0  # virtual start time of its head
    finish: float = 0.0  # virtual finish time of the last request it had dispatched
    in_order: bool = False  # has an entry in the dispatch heap


class FairQueue(Generic[T]):
    """Per-org FIFOs under weighted fair dispatch (module doc).

    ``weights``: org -> weight for the orgs configured; every other org weighs ``default_weight``.
    """

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0) -> None:
        if default_weight <= 0 or any(w <= 0 for w in (weights or {}).values()):
            raise ValueError("org weights must be positive")
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.orgs: dict[str, OrgQueue[T]] = {}  # orgs with items (live or dead) or in the order
        self.idle: dict[str, float] = {}  # org -> finish, for orgs gone idle with a finish ahead of vtime
        self.idle_cap = IDLE_CAP
        self.order: list[tuple[float, int, str]] = []  # (tag, seq, org): orgs with work, lowest tag first
        self.fullest: list[tuple[float, int, str, int]] = []  # (-live/weight, seq, org, live), lazily pruned
        self.vtime = 0.0  # the tag of the last request dispatched
        self.seq = 0  # ties between equal tags go to the org that joined first
        self.live = 0
        self.active = 0  # orgs with live items
        self.active_weight = 0.0  # their weights' sum: what an org's share is a part of

    # ------------------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self.live

    def __bool__(self) -> bool:
        return self.live > 0

    def weight(self, org: str) -> float:
        return self.weights.get(org, self.default_weight)

    def queued(self, org: str) -> int:
        q = self.orgs.get(org)
        return 0 if q is None else q.live

    def share(self, org: str) -> float:
        """The part of the service an org is due while the orgs with work now keep it up (it
        included): its weight over theirs; 1.0 alone."""
        w = self.weight(org)
        return w / (self.active_weight + (0.0 if self.queued(org) else w))

    def fullest_org(self) -> str | None:
        """The org with most live items per weight, None with nothing queued; O(log orgs)."""
        return self._fullest()

    def queued_by_org(self) -> Iterator[tuple[str, int]]:
        """(org, live items) for every org with work; O(orgs), for snapshots."""
        return ((org, q.live) for org, q in self.orgs.items() if q.live)

    # ------------------------------------------------------------------------------ writing

    def push(self, org: str, item: T, *, front: bool = False) -> None:
        """``item`` waits at the back of ``org``'s FIFO (``front``: at its head, for an item that
        was taken and could not be sent); the org joins the dispatch order if it was out of it."""
        q = self.orgs.get(org)
        if q is None:
            q = self.orgs[org] = OrgQueue(self.weights.get(org, self.default_weight))
        if front:
            q.items.appendleft(item)
        else:
            q.items.append(item)
        if q.live == 0:
            self.active += 1
            self.active_weight += q.weight
        q.live += 1
        self.live += 1
        self.seq += 1
        if not q.in_order:
            q.tag = max(self.vtime, q.finish, self.idle.pop(org, 0.0)) if self.idle else max(self.vtime, q.finish)
            q.in_order = True
            heapq.heappush(self.order, (q.tag, self.seq, org))
        heapq.heappush(self.fullest, (-q.live / q.weight, self.seq, org, q.live))
        if len(self.fullest) > 2 * self.active + 64:
            self._rebuild_fullest()

    def push_front(self, org: str, item: T) -> None:
        self.push(org, item, front=True)

    def _lost(self, q: OrgQueue[T]) -> None:
        """``q`` holds one live item fewer."""
        q.live -= 1
        self.live -= 1
        if q.live == 0:
            self.active -= 1
            self.active_weight = self.active_weight - q.weight if self.active else 0.0
            q.items.clear()
            q.dead.clear()

    def oldest(self, org: str) -> T | None:
        """The live item that has waited longest in ``org``'s FIFO (dead entries ahead of it are
        dropped on the way), or None."""
        q = self.orgs.get(org)
        if q is None or not q.live:
            return None
        while q.items:
            item = q.items[0]
            if not q.dead or not q.dead.get(item):
                return item
            q.items.popleft()
            self._is_dead(q, item)
        return None  # unreachable while the counts hold: a live org has a live item

    def pop(self, newest_first: Container[str] = (), skip: Container[str] = ()) -> tuple[str, T] | None:
        """The next (org, item) in fair order, or None when nothing waits. The org whose turn it is
        gives its oldest item, or its newest when it is in ``newest_first`` (adaptive LIFO: the
        broker's orgs with a standing queue). Orgs in ``skip`` give nothing now and keep their
        place in the order (the broker's orgs whose held slots take every free one)."""
        order = self.order
        aside: list[tuple[float, int, str]] = []
        try:
            while order:
                tag, _, org = order[0]
                if org in skip:
                    aside.append(heapq.heappop(order))
                    continue
                q = self.orgs[org]
                if org in newest_first:
                    item = self._newest_live(q)
                else:
                    item = self._next_live(q) if q.dead else (q.items.popleft() if q.items else None)
                if item is None:  # nothing live left: out of the order until it has work again
                    heapq.heappop(order)
                    q.in_order = False
                    self._forget_if_idle(org, q)
                    continue
                self.vtime = tag
                q.finish = tag + 1.0 / q.weight
                self._lost(q)
                if q.items:
                    q.tag = q.finish
                    self.seq += 1
                    heapq.heapreplace(order, (q.tag, self.seq, org))
                else:
                    heapq.heappop(order)
                    q.in_order = False
                    self._forget_if_idle(org, q)
                return org, item
            return None
        finally:
            for entry in aside:
                heapq.heappush(order, entry)

    def remove(self, org: str, item: T) -> None:
        """``item`` (waiting in ``org``'s FIFO) no longer waits: O(1), its entry is skipped later."""
        q = self.orgs.get(org)
        if q is None or q.live == 0:
            return
        q.dead[item] += 1
        self._lost(q)
        if q.live and len(q.items) > 2 * q.live + COMPACT_SLACK:
            live = collections.deque(x for x in q.items if not self._is_dead(q, x))
            q.items = live

    def push_out(self, org: str, limit: int) -> tuple[str, T] | None:
        """Room for an arrival of ``org`` when ``limit`` items wait: when ``org`` holds less than
        its share of ``limit`` (weight over the weights of the orgs with work, it included), the
        newest item of the org with most items per weight is taken out and returned as (org,
        item), to be refused; else None (the arrival is at or over its share and is refused)."""
        w = self.weight(org)
        mine = self.queued(org)
        if (mine + 1) * (self.active_weight + (0.0 if mine else w)) > limit * w:
            return None
        victim = self._fullest()
        if victim is None or victim == org:
            return None
        q = self.orgs[victim]
        while q.items:
            item = q.items.pop()
            if not self._is_dead(q, item):
                self._lost(q)
                return victim, item
        return None  # unreachable while the counts hold: a live org has a live item

    # ---------------------------------------------------------------------------- internals

    @staticmethod
    def _is_dead(q: OrgQueue[T], item: T) -> bool:
        """Whether this entry of ``item`` is a dead one (and uses up one dead mark if so)."""
        n = q.dead.get(item, 0)
        if not n:
            return False
        if n == 1:
            del q.dead[item]
        else:
            q.dead[item] = n - 1
        return True

    def _next_live(self, q: OrgQueue[T]) -> T | None:
        while q.items:
            item = q.items.popleft()
            if not q.dead or not self._is_dead(q, item):
                return item
        return None

    def _newest_live(self, q: OrgQueue[T]) -> T | None:
        while q.items:
            item = q.items.pop()
            if not q.dead or not self._is_dead(q, item):
                return item
        return None

    def _forget_if_idle(self, org: str, q: OrgQueue[T]) -> None:
        """Drop the record of an org out of the order with nothing in its FIFO; a finish ahead of
        the virtual time is kept aside, so an org that empties and comes straight back is not
        served earlier than its share allows. That side table is pruned of finishes the virtual
        time has passed (an org would join at the virtual time anyway) when it doubles."""
        if q.items or q.in_order:
            return
        del self.orgs[org]
        if q.finish > self.vtime:
            self.idle[org] = q.finish
            if len(self.idle) > self.idle_cap:
                self.idle = {o: f for o, f in self.idle.items() if f > self.vtime}
                self.idle_cap = max(IDLE_CAP, 2 * len(self.idle))

    def _fullest(self) -> str | None:
        """The org with most live items per weight (heap entries that are out of date are dropped)."""
        while self.fullest:
            _, _, org, live = self.fullest[0]
            q = self.orgs.get(org)
            if q is not None and q.live == live and live > 0:
                return org
            heapq.heappop(self.fullest)
            if q is not None and q.live > 0:
                self.seq += 1
                heapq.heappush(self.fullest, (-q.live / q.weight, self.seq, org, q.live))
        return None

    def _rebuild_fullest(self) -> None:
        self.fullest = []
        for org, q in self.orgs.items():
            if q.live:
                self.seq += 1
                self.fullest.append((-q.live / q.weight, self.seq, org, q.live))
        heapq.heapify(self.fullest)
