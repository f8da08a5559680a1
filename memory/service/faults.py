"""Run-time fault injection for the reference memory service (``--enable-faults`` only).

Tests and benchmarks switch faults per endpoint (``hot``, ``search``) through ``PUT /_faults``
to exercise the workers' degradation paths against real HTTP: latency, error statuses, truncated
JSON, multi-megabyte bodies and connections closed without any response.

Dropping a connection needs the socket, which ASGI does not expose. ``TrackingH11Protocol`` is
uvicorn's h11 protocol plus a registry of live transports keyed by the client address, the same
``(host, port)`` the app sees in ``scope["client"]``.
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from typing import Any, cast

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .models import FaultSpec

ENDPOINTS = ("hot", "search")

Address = tuple[str, int]
_LIVE: dict[Address, tuple[asyncio.Transport, asyncio.Event]] = {}


class CoalescingTransport:
    """A transport whose writes of one loop iteration go out as one ``write``.

    uvicorn writes a response's head and its body separately, two sends where one does; on
    loopback each send costs the service more CPU than the whole response's Python.
    Buffered bytes are sent at the end of the current loop iteration, or first by ``close``.
    Everything else is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data if isinstance(data, bytes) else bytes(data))

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Tracking:
    """Registers each connection's transport for ``drop_connection`` and coalesces its writes
    (mixed into uvicorn's protocols)."""

    client: tuple[str, int] | None
    transport: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.transport = CoalescingTransport(cast(asyncio.Transport, transport))
        if self.client is not None:
            _LIVE[(self.client[0], self.client[1])] = (cast(asyncio.Transport, transport), asyncio.Event())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:
            entry = _LIVE.pop((self.client[0], self.client[1]), None)
            if entry is not None:
                entry[1].set()
        super().connection_lost(exc)  # type: ignore[misc]


class TrackingH11Protocol(_Tracking, H11Protocol):
    """uvicorn's pure-Python h11 protocol, with connection tracking."""


class TrackingHttpToolsProtocol(_Tracking, HttpToolsProtocol):
    """uvicorn's httptools (C parser) protocol, with connection tracking: the default, about twice
    as cheap per request as h11."""


async def drop_connection(client: Address | None, *, timeout_s: float = 2.0) -> bool:
    """Close the client's connection without a response; ``False`` if it cannot be found."""
    entry = _LIVE.get(client) if client is not None else None
    if entry is None:
        return False
    transport, lost = entry
    transport.close()
    try:
        await asyncio.wait_for(lost.wait(), timeout_s)
    except TimeoutError:
        transport.abort()
    return True


class Faults:
    """Current faults per endpoint; ``all`` sets (and clears) both."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, FaultSpec] = {}

    def set(self, spec: FaultSpec) -> None:
        for ep in ENDPOINTS if spec.endpoint == "all" else (spec.endpoint,):
            self._by_endpoint[ep] = spec.model_copy(update={"endpoint": ep})

    def clear(self, endpoint: str = "all") -> None:
        if endpoint == "all":
            self._by_endpoint.clear()
        else:
            self._by_endpoint.pop(endpoint, None)

    def get(self, endpoint: str) -> FaultSpec | None:
        return self._by_endpoint.get(endpoint)

    def snapshot(self) -> dict[str, Any]:
        return {ep: spec.model_dump(exclude={"endpoint"}) for ep, spec in sorted(self._by_endpoint.items())}


MALFORMED_BODY = b'{"memories": [{"memory_id": "m-truncated", "content": "this body stops mid-str'


@lru_cache(maxsize=4)
def huge_body(size: int) -> bytes:
    """A valid ``{"memories": [...]}`` body of at least ``size`` bytes (64 KiB memories)."""
    chunk = "x" * 65_536
    hit = {"memory_id": "m-huge", "content": chunk, "category": "fact", "similarity": 0.9,
           "confidence": 0.9, "rank": 1}
    one = len(json.dumps(hit)) + 2
    hits = [{**hit, "memory_id": f"m-huge-{i}", "rank": i + 1} for i in range(size // one + 1)]
    return json.dumps({"memories": hits}).encode()
