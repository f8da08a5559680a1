"""Concurrent new questions embedded as one batch (a new question is the memory
service's dearest call, ~10 ms of MiniLM forward pass), served to orgs by weighted fair share.

The first query starts at once, alone, in a worker thread; queries that arrive while it runs wait
and go together in the next forward pass (at most ``max_batch``). So an idle service adds no
latency, and a busy one spends about half the CPU per query (one padded GEMM per layer for the
batch instead of one per query; ``MiniLM.encode_queries``). Results match one-at-a-time
embedding to ~1e-7.

Waiting queries are ordered by start-time fair queueing: each gets a tag, its org's previous tag
(or the batcher's virtual time, if later) plus ``1 / weight``; a batch takes the lowest tags. An
org alone uses every batch; orgs with work share the batches by weight, and one that sends more
than its share queues behind its own work only.

No work is started that nobody will wait for:

* a query whose callers' deadlines (``memory.service.deadline.Horizon``) passed while it waited is dropped
  when its batch is formed, not embedded;
* a query whose embedding, by the measured batch time and the queries fair order puts ahead of
  it, would end too late to be answered by its caller's deadline (the measured time a search
  takes after its vector, ``note_after``, counts) is refused on arrival (``WouldMissDeadline``, 503,
  counted in ``refused``): the caller learns at once, instead of waiting out its deadline while
  the work it would throw away delays the calls that still can be answered. An org over its
  share has the most queued ahead of its own new queries, so its queries are refused first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from starlette.concurrency import run_in_threadpool

from .deadline import DeadlinePassed, Horizon
from .http import ApiError

R = TypeVar("R")  # what the batch function gives per query (a vector, or a vector and its token states)
EWMA = 0.2  # weight of one batch in the measured batch time


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


class QueryBatcher(Generic[R]):
    """Embeds queries with ``embed_many`` in a worker thread, batching the ones that queue up."""

    def __init__(self, embed_many: Callable[[Sequence[str]], Iterable[R]], max_batch: int = 8,
                 weights: Mapping[str, float] | None = None, batch_target_s: float | None = None) -> None:
        """``batch_target_s``: the longest a batch should take (module doc); None: ``max_batch`` only."""
        self._embed_many = embed_many
        self._max_batch = max_batch
        self._batch_target_s = batch_target_s
        self._weights = dict(weights or {})
        self._pending: list[_Waiting] = []  # a heap on (tag, seq)
        self._last_tag: dict[str, float] = {}  # orgs with queries waiting -> their latest tag
        self._vtime = 0.0  # the tag of the last query taken into a batch
        self._seq = itertools.count()
        self._drainer: asyncio.Task[None] | None = None
        self._running_since: float | None = None  # monotonic start of the batch being embedded
        self.batch_s = 0.0  # measured time of one batch (0: nothing measured yet)
        self.after_s = 0.0  # measured time a call still needs once its vector is known (the search)
        self.query_s = 0.0  # measured time of one query's share of a batch
        self.batches = 0
        self.queries = 0
        self.dropped = 0  # queries whose callers had all gone before their batch
        self.refused = 0  # queries refused on arrival: they would have ended after their deadline

    def weight(self, org: str) -> float:
        return self._weights.get(org, 1.0)

    def batch_cap(self) -> int:
        """Queries the next batch may take: ``max_batch``, or fewer when ``batch_target_s`` holds
        fewer at the measured time per query (never fewer than one)."""
        if self._batch_target_s is None or self.query_s <= 0:
            return self._max_batch
        return max(1, min(self._max_batch, int(self._batch_target_s / self.query_s)))

    def expected_end(self, tag: float, now: float) -> float:
        """When a query tagged ``tag`` would be embedded: the running batch's rest, then one batch
        per ``batch_cap()`` queries tagged before it, then its own."""
        ahead = sum(1 for w in self._pending if w.tag < tag)
        rest = 0.0 if self._running_since is None else max(0.0, self._running_since + self.batch_s - now)
        return now + rest + (ahead // self.batch_cap() + 1) * self.batch_s

    def note_after(self, took_s: float) -> None:
        """A call's time after its vector (the engine's search and the answer), into ``after_s``."""
        self.after_s = smoothed(self.after_s, took_s)

    async def embed(self, text: str, horizon: Horizon | None = None, org: str = "") -> R:
        """``text``'s vector; ``DeadlinePassed`` if ``horizon`` passes before its batch starts,
        ``WouldMissDeadline`` at once if its batch would end after it."""
        horizon = horizon or Horizon(None)
        tag = max(self._vtime, self._last_tag.get(org, 0.0)) + 1.0 / self.weight(org)
        now = time.monotonic()
        if horizon.at is not None and self.batch_s > 0 and (self._pending or self._running_since is not None):
            end = self.expected_end(tag, now) + self.after_s
            if end > horizon.at:
                self.refused += 1
                raise WouldMissDeadline((end - horizon.at) * 1000.0)
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._last_tag[org] = tag
        heapq.heappush(self._pending, _Waiting(tag, next(self._seq), text, fut, horizon, org))
        if self._drainer is None:
            self._drainer = asyncio.ensure_future(self._drain())
        return await fut

    def _next_batch(self) -> list[_Waiting]:
        """Up to ``batch_cap()`` waiting queries someone still waits for, lowest tags first; the
        others are failed."""
        now = time.monotonic()
        batch: list[_Waiting] = []
        cap = self.batch_cap()
        while self._pending and len(batch) < cap:
            item = heapq.heappop(self._pending)
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

    async def _run(self, batch: list[_Waiting]) -> None:
        self.batches += 1
        self.queries += len(batch)
        self._running_since = started = time.monotonic()
        try:
            rows = list(await run_in_threadpool(self._embed_many, [w.text for w in batch]))
        except Exception as exc:  # each waiting call fails the way a lone embedding would
            for w in batch:
                if not w.fut.done():
                    w.fut.set_exception(exc)
            return
        finally:
            self._running_since = None
        took = time.monotonic() - started
        self.batch_s = smoothed(self.batch_s, took)
        self.query_s = smoothed(self.query_s, took / len(batch))
        for w, row in zip(batch, rows, strict=True):
            if not w.fut.done():
                w.fut.set_result(row)

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._next_batch()
                if batch:
                    await self._run(batch)
        finally:
            self._drainer = None
