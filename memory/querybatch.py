"""Concurrent new questions embedded as one batch (a new question is the memory
service's dearest call, ~10 ms of MiniLM forward pass).

The first query starts at once, alone, in a worker thread; queries that arrive while it runs wait
and go together in the next forward pass (at most ``max_batch``). So an idle service adds no
latency, and a busy one spends about half the CPU per query (one padded GEMM per layer for the
batch instead of one per query; ``MiniLM.encode_queries``). Results match one-at-a-time
embedding to ~1e-7. A query whose callers' deadlines (``memory.deadline.Horizon``) passed while it
waited is dropped when its batch is formed, not embedded: under overload the queue would
otherwise hold work nobody waits for, ahead of calls that still can be answered.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence

from starlette.concurrency import run_in_threadpool

from ibex_context.memory.deadline import DeadlinePassed, Horizon
from ibex_context.memory.embed import Vectors

EmbedMany = Callable[[Sequence[str]], Vectors]


class QueryBatcher:
    """Embeds queries with ``embed_many`` in a worker thread, batching the ones that queue up."""

    def __init__(self, embed_many: EmbedMany, max_batch: int = 8) -> None:
        self._embed_many = embed_many
        self._max_batch = max_batch
        self._pending: collections.deque[tuple[str, asyncio.Future[Vectors], Horizon]] = collections.deque()
        self._drainer: asyncio.Task[None] | None = None
        self.batches = 0
        self.queries = 0
        self.dropped = 0  # queries whose callers had all gone before their batch

    async def embed(self, text: str, horizon: Horizon | None = None) -> Vectors:
        """``text``'s vector; ``DeadlinePassed`` if ``horizon`` passes before its batch starts."""
        fut: asyncio.Future[Vectors] = asyncio.get_running_loop().create_future()
        self._pending.append((text, fut, horizon or Horizon(None)))
        if self._drainer is None:
            self._drainer = asyncio.ensure_future(self._drain())
        return await fut

    def _next_batch(self) -> list[tuple[str, asyncio.Future[Vectors], Horizon]]:
        """Up to ``max_batch`` waiting queries someone still waits for; the others are failed."""
        now = time.monotonic()
        batch: list[tuple[str, asyncio.Future[Vectors], Horizon]] = []
        while self._pending and len(batch) < self._max_batch:
            item = self._pending.popleft()
            if item[2].passed(now):
                self.dropped += 1
                if not item[1].done():
                    item[1].set_exception(DeadlinePassed("the query embedding"))
            else:
                batch.append(item)
        return batch

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._next_batch()
                if not batch:
                    continue
                self.batches += 1
                self.queries += len(batch)
                try:
                    vectors = await run_in_threadpool(self._embed_many, [text for text, _, _ in batch])
                except Exception as exc:  # each waiting call fails the way a lone embedding would
                    for _, fut, _ in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut, _), vec in zip(batch, vectors, strict=True):
                    if not fut.done():
                        fut.set_result(vec)
        finally:
            self._drainer = None
