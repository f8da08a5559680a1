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

from ibex_context.memory.models import FaultSpec

ENDPOINTS = ("hot", "search")

Address = tuple[str, int]
_LIVE: dict[Address, tuple[asyncio.Transport, asyncio.Event]] = {}


class _Tracking:
    """Registers each connection's transport for ``drop_connection`` (mixed into uvicorn's protocols)."""

    client: tuple[str, int] | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
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
