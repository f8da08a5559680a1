"""Open-loop targets for ``bench.peers``: the same requests, the same outcome vocabulary as
``bench.loadgen.ClientTarget`` (OK, or the error code the server answered, or DEADLINE_EXCEEDED
when the client's own timeout fired first), over grpc.aio and over HTTP (aiohttp).

Each request is stamped with its absolute deadline and packed by the client library's own
``encode_with_deadline``, so the three systems receive the same bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

from bench.loadgen import OK, Reply
from bench.workload import as_requests
from ibex_context.client.requests import encode_with_deadline
from ibex_context.shared.wire.codec import decode_reply
from ibex_context.shared.wire.models import AssembleRequest, ErrorReply

# Connections per peer client: SO_REUSEPORT spreads connections (not requests) over the server
# processes, so a single connection would load one process only.
CONNECTIONS = 8


def to_reply(body: bytes) -> Reply:
    decoded = decode_reply(body)
    if isinstance(decoded, ErrorReply):
        return Reply(decoded.code.value)
    return Reply(OK, dict(decoded.timings_us), decoded.degraded, decoded.worker_id, tuple(decoded.degraded_reasons))


def _payload(tmpl: AssembleRequest, rid: str, timeout_s: float) -> bytes:
    req = tmpl.model_copy(update={"request_id": rid})
    return encode_with_deadline(req, {}, time.time_ns() + int(timeout_s * 1e9))[1]


class GrpcTarget:
    """grpc.aio client: ``CONNECTIONS`` channels (own subchannel pools, so own connections), round-robin."""

    def __init__(self, port: int, templates: Sequence[AssembleRequest], *, method: str, tag: str) -> None:
        import grpc

        self._grpc = grpc
        self.requests = as_requests(templates)
        self.tag = tag
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                   options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(CONNECTIONS)]
        self.stubs = [ch.unary_unary(f"/ibex.Context/{method}") for ch in self.channels]
        self._rr = itertools.cycle(range(CONNECTIONS))

    async def ready(self, timeout_s: float = 30.0) -> None:
        """Every channel connected (channels connect lazily; a first call on one still connecting
        would fail UNAVAILABLE inside a timed run)."""
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(ch.channel_ready() for ch in self.channels))

    async def __call__(self, i: int, timeout_s: float) -> Reply:
        payload = _payload(self.requests.nth(i), f"{self.tag}-{i}", timeout_s)
        stub = self.stubs[next(self._rr)]
        try:
            body: Any = await stub(payload, timeout=timeout_s)
        except self._grpc.aio.AioRpcError as exc:
            code = exc.code()
            expired = code == self._grpc.StatusCode.DEADLINE_EXCEEDED
            return Reply("DEADLINE_EXCEEDED" if expired else f"GRPC:{code.name}")
        return to_reply(body)

    async def aclose(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels))


class HttpTarget:
    """aiohttp client with a pool of keep-alive connections (the way a Python proxy calls HTTP)."""

    def __init__(self, port: int, templates: Sequence[AssembleRequest], *, path: str, tag: str) -> None:
        self.url = f"http://127.0.0.1:{port}{path}"
        self.requests = as_requests(templates)
        self.tag = tag
        self.session: Any = None

    async def __call__(self, i: int, timeout_s: float) -> Reply:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256),
                                                 headers={"content-type": "application/msgpack"})
        payload = _payload(self.requests.nth(i), f"{self.tag}-{i}", timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(self.url, data=payload) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        return Reply(f"HTTP:{resp.status}")
        except TimeoutError:
            return Reply("DEADLINE_EXCEEDED")
        except aiohttp.ClientError as exc:
            return Reply(f"EXC:{type(exc).__name__}")
        return to_reply(body)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
