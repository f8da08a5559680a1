"""One request at a time on one asyncio connection: what the worker's two lean clients share
(``worker.memhttp`` for the memory service, ``worker.rawredis`` for the directive GET).

A connection holds at most one outstanding request. ``_ask`` writes it and returns the future its
answer settles; ``_fail`` settles that future with an error and closes the connection, so an
answer that arrives late can never be read as the next request's.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Exchange(asyncio.Protocol, Generic[T]):
    """Base protocol: subclasses parse ``data_received`` and settle ``waiter`` with ``T``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[T] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(self._lost())

    def _lost(self) -> Exception:
        """The error an outstanding request gets when the peer closes the connection."""
        return ConnectionError("Connection closed by server.")

    def _ask(self, request: bytes) -> asyncio.Future[T]:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
