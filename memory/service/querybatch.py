"""Concurrent new questions embedded as one batch (a new question is the memory
service's dearest call, ~10 ms of MiniLM forward pass), served to orgs by weighted fair share.

The first query starts at once, alone, on a thread of its own; queries that arrive while it runs
wait and go together in the next forward pass (at most ``max_batch``, and no more than fit in
``batch_target_s`` at the measured time per query). So an idle service adds no latency.

Waiting queries are ordered by start-time fair queueing: each gets a tag, its org's previous tag
(or the batcher's virtual time, if later) plus ``1 / weight``; a batch takes the lowest tags. An
org alone uses every batch; orgs with work share the batches by weight, and one that sends more
than its share queues behind its own work only.

**Two lanes.** Fair order alone still leaves a light org's question behind the batch being
embedded, and on a machine the flood keeps busy that batch and its own run slower for every other
runnable thread. So while two or more orgs have questions in (or had in the last second or so),
an org using under ``LIGHT_SHARE`` of its weighted share of one embedding thread over the last
``USAGE_TAU_S`` (what it used, decayed, plus what it has queued) is embedded on the **urgent**
lane, at the process's priority, and the others on the **bulk** lane, a thread of its own at nice
``bulk_nice``. (At the share itself, a flood served about what one thread embeds sits near the
line and would cross it back and forth, taking the urgent lane half the time.) A light org's
question then never waits for a flood's batch, and when the CPU is short the kernel runs it
first (CFS weights: nice 10 weighs about a tenth of nice 0), as FQ-CoDel serves sparse flows
first, but preemptively. An org alone is never on the bulk lane: with nobody
to yield to, it has the urgent lane as before. Each lane keeps its own fair queue and measures
its own batch time (the bulk lane's stretches when it yields).

No work is started that nobody will wait for:

* a query whose callers' deadlines (``memory.service.deadline.Horizon``) passed while it waited is dropped
  when its batch is formed, not embedded;
* a query whose embedding, by its lane's measured batch time and the queries fair order puts ahead
  of it, would end too late to be answered by its caller's deadline (the measured time a search
  takes after its vector, ``note_after``, counts) is refused on arrival (``WouldMissDeadline``, 503,
  counted in ``refused``): the caller learns at once, instead of waiting out its deadline while
  the work it would throw away delays the calls that still can be answered. An org over its
  share has the most queued ahead of its own new queries, on the lane that yields, so its queries
  are refused first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .deadline import DeadlinePassed, Horizon
from .http import ApiError
from .write_threads import WriteThreads

R = TypeVar("R")  # what the batch function gives per query (a vector, or a vector and its token states)
EWMA = 0.2  # weight of one batch in the measured batch time
USAGE_TAU_S = 1.0  # an org's embedding time is remembered with this time constant
USAGE_SEEN_S = 1e-3  # an org whose decayed embedding time is under this (and with nothing in) is not active
LIGHT_SHARE = 0.5  # an org using under this part of its share of one thread stays on the urgent lane


def smoothed(mean: float, sample: float, weight: float = EWMA) -> float:
    """``mean`` moved ``weight`` of the way to ``sample`` (an exponentially weighted mean); the
    first sample (``mean`` 0: nothing measured yet) is taken whole."""
    return sample if mean == 0 else mean + weight * (sample - mean)


class WouldMissDeadline(ApiError):
    """The query's embedding would end after its caller's deadline: refused at once (503)."""

    def __init__(self, late_ms: float) -> None:
        super().__init__(503, f"the memory service is at capacity: the query embedding would end {late_ms:.1f} ms "
                              "after the caller's deadline (Ibex-Timeout-Ms)")


@dataclass(order=True, slots=True)
class _Waiting:
    tag: float
    seq: int
    text: str = field(compare=False)
    fut: asyncio.Future[Any] = field(compare=False)
    horizon: Horizon = field(compare=False)
    org: str = field(compare=False)


class Lane:
    """One embedding thread and the fair queue of the questions waiting for it."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self.thread = WriteThreads(1, nice, name=f"query-{name}")
        self.pending: list[_Waiting] = []  # a heap on (tag, seq)
        self.drainer: asyncio.Task[None] | None = None
        self.running_since: float | None = None  # monotonic start of the batch being embedded
        self.batch_s = 0.0  # measured time of one batch (0: nothing measured yet)
        self.query_s = 0.0  # measured time of one query's share of a batch
        self.batches = 0
        self.queries = 0


class _Usage:
    """An org's embedding time, decayed with ``USAGE_TAU_S``, and its queries in the batcher."""

    __slots__ = ("at", "in_batcher", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.at = 0.0
        self.in_batcher = 0

    def decayed(self, now: float) -> float:
        return self.seconds * math.exp(-(now - self.at) / USAGE_TAU_S) if self.seconds else 0.0

    def add(self, seconds: float, now: float) -> None:
        self.seconds = self.decayed(now) + seconds
        self.at = now


class QueryBatcher(Generic[R]):
    """Embeds queries with ``embed_many`` on two lane threads, batching the ones that queue up."""

    def __init__(self, embed_many: Callable[[Sequence[str]], Iterable[R]], max_batch: int = 8,
                 weights: Mapping[str, float] | None = None, batch_target_s: float | None = None,
                 bulk_nice: int = 10) -> None:
        """``batch_target_s``: the longest a batch should take (module doc); None: ``max_batch`` only.
        ``bulk_nice``: the bulk lane's nice value (0: the process's priority)."""
        self._embed_many = embed_many
        self._max_batch = max_batch
        self._batch_target_s = batch_target_s
        self._weights = dict(weights or {})
        self.urgent = Lane("urgent")
        self.bulk = Lane("bulk", bulk_nice)
        self._last_tag: dict[str, float] = {}  # orgs with queries waiting -> their latest tag
        self._vtime = 0.0  # the tag of the last query taken into a batch
        self._seq = itertools.count()
        self._usage: dict[str, _Usage] = {}
        self.after_s = 0.0  # measured time a call still needs once its vector is known (the search)
        self.dropped = 0  # queries whose callers had all gone before their batch
        self.refused = 0  # queries refused on arrival: they would have ended after their deadline

    @property
    def batches(self) -> int:
        return self.urgent.batches + self.bulk.batches

    @property
    def queries(self) -> int:
        return self.urgent.queries + self.bulk.queries

    def weight(self, org: str) -> float:
        return self._weights.get(org, 1.0)

    def batch_cap(self, lane: Lane | None = None) -> int:
        """Queries ``lane``'s next batch may take: ``max_batch``, or fewer when ``batch_target_s``
        holds fewer at its measured time per query (never fewer than one)."""
        lane = lane or self.urgent
        if self._batch_target_s is None or lane.query_s <= 0:
            return self._max_batch
        return max(1, min(self._max_batch, int(self._batch_target_s / lane.query_s)))

    def lane_for(self, org: str, now: float) -> Lane:
        """The urgent lane for an org alone, or one using under ``LIGHT_SHARE`` of its weighted
        share of one embedding thread; the bulk lane otherwise (module doc)."""
        active = self._active(now)
        if org not in active or len(active) < 2:
            return self.urgent
        usage = active[org]
        per_query = self.urgent.query_s or self.bulk.query_s
        demand = (usage.decayed(now) + usage.in_batcher * per_query) / USAGE_TAU_S
        share = self.weight(org) / sum(self.weight(o) for o in active)
        return self.urgent if demand < LIGHT_SHARE * share else self.bulk

    def expected_end(self, tag: float, now: float, lane: Lane | None = None) -> float:
        """When a query tagged ``tag`` would be embedded on ``lane``: its running batch's rest, then
        one batch per ``batch_cap()`` queries tagged before it, then its own."""
        lane = lane or self.urgent
        ahead = sum(1 for w in lane.pending if w.tag < tag)
        rest = 0.0 if lane.running_since is None else max(0.0, lane.running_since + lane.batch_s - now)
        return now + rest + (ahead // self.batch_cap(lane) + 1) * lane.batch_s

    def note_after(self, took_s: float) -> None:
        """A call's time after its vector (the engine's search and the answer), into ``after_s``."""
        self.after_s = smoothed(self.after_s, took_s)

    async def embed(self, text: str, horizon: Horizon | None = None, org: str = "") -> R:
        """``text``'s vector; ``DeadlinePassed`` if ``horizon`` passes before its batch starts,
        ``WouldMissDeadline`` at once if its batch would end after it."""
        horizon = horizon or Horizon(None)
        tag = max(self._vtime, self._last_tag.get(org, 0.0)) + 1.0 / self.weight(org)
        now = time.monotonic()
        usage = self._usage.get(org)
        if usage is None:
            if len(self._usage) >= 4096:
                self._forget(now)
            usage = self._usage[org] = _Usage()
        lane = self.lane_for(org, now)
        busy = lane.pending or lane.running_since is not None
        if horizon.at is not None and lane.batch_s > 0 and busy:
            end = self.expected_end(tag, now, lane) + self.after_s
            if end > horizon.at:
                self.refused += 1
                raise WouldMissDeadline((end - horizon.at) * 1000.0)
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._last_tag[org] = tag
        usage.in_batcher += 1
        heapq.heappush(lane.pending, _Waiting(tag, next(self._seq), text, fut, horizon, org))
        if lane.drainer is None:
            lane.drainer = asyncio.ensure_future(self._drain(lane))
        try:
            return await fut
        finally:
            usage.in_batcher -= 1

    def _forget(self, now: float) -> None:
        """Drop the orgs no longer active, so the table stays bounded."""
        self._usage = self._active(now)

    def _active(self, now: float) -> dict[str, _Usage]:
        """The orgs with questions in, or whose decayed embedding time is at least ``USAGE_SEEN_S``."""
        return {o: u for o, u in self._usage.items() if u.in_batcher or u.decayed(now) >= USAGE_SEEN_S}

    def _next_batch(self, lane: Lane) -> list[_Waiting]:
        """Up to ``batch_cap()`` waiting queries someone still waits for, lowest tags first; the
        others are failed."""
        now = time.monotonic()
        batch: list[_Waiting] = []
        cap = self.batch_cap(lane)
        while lane.pending and len(batch) < cap:
            item = heapq.heappop(lane.pending)
            self._vtime = max(self._vtime, item.tag)
            if self._last_tag.get(item.org) == item.tag:  # its org's last: the org has nothing queued
                del self._last_tag[item.org]
            if item.horizon.passed(now):
                self.dropped += 1
                if not item.fut.done():
                    item.fut.set_exception(DeadlinePassed("the query embedding"))
            else:
                batch.append(item)
        return batch

    async def _run(self, lane: Lane, batch: list[_Waiting]) -> None:
        lane.batches += 1
        lane.queries += len(batch)
        lane.running_since = started = time.monotonic()
        try:
            rows = list(await lane.thread.run(self._embed_many, [w.text for w in batch]))
        except Exception as exc:  # each waiting call fails the way a lone embedding would
            for w in batch:
                if not w.fut.done():
                    w.fut.set_exception(exc)
            return
        finally:
            lane.running_since = None
        now = time.monotonic()
        took = now - started
        lane.batch_s = smoothed(lane.batch_s, took)
        lane.query_s = smoothed(lane.query_s, took / len(batch))
        for w, row in zip(batch, rows, strict=True):
            usage = self._usage.get(w.org)
            if usage is not None:
                usage.add(took / len(batch), now)
            if not w.fut.done():
                w.fut.set_result(row)

    async def _drain(self, lane: Lane) -> None:
        try:
            while lane.pending:
                batch = self._next_batch(lane)
                if batch:
                    await self._run(lane, batch)
        finally:
            lane.drainer = None
