"""The proxy's client library: asyncio and sync clients over ZeroMQ DEALER sockets.

* ``assemble(request, timeout=...)`` stamps the absolute deadline (Unix epoch ns = now + timeout)
  and enforces it itself: nothing is handed back after the deadline, whatever the network does.
* One or more broker endpoints: requests go round-robin to connected brokers; OVERLOADED,
  UNAVAILABLE or a broker disconnect fail over to the next broker while time remains.
* A broker restart is seen through the socket monitor: requests in flight on it end at once
  (retried elsewhere or UNAVAILABLE) instead of waiting for their deadline; the socket reconnects.
* ``assemble_or_degrade`` never raises for service faults: it returns a degraded, history-only
  response built by the same pure pipeline, with the reason recorded, so the proxy never
  special-cases an outage. Caller faults (INVALID_REQUEST, FORBIDDEN, UNAUTHENTICATED) still raise.

Thread safety: ``AsyncClient`` belongs to the event loop that first uses it and is safe to share
across tasks on that loop. ``SyncClient`` runs its own loop on a background thread and is safe to
share across threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from shared import protocol as P
from shared.codec import decode_reply, encode
from shared.errors import (
    ERROR_BY_CODE,
    DeadlineExceeded,
    ErrorCode,
    IbexError,
    Internal,
    Unauthenticated,
    Unavailable,
)
from shared.loopsock import LoopSocket
from shared.models import AssembleRequest, AssembleResponse, BranchOutcome, ErrorReply
from shared.settings import Settings

log = logging.getLogger(__name__)

RETRYABLE = {ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.UNAUTHENTICATED}
CALLER_FAULTS = {ErrorCode.INVALID_REQUEST, ErrorCode.FORBIDDEN, ErrorCode.UNAUTHENTICATED}
MIN_RETRY_S = 0.002
T = TypeVar("T")


@dataclass
class _Conn:
    endpoint: str
    sock: LoopSocket = field(init=False)
    monitor: LoopSocket = field(init=False)
    connected: bool = False
    auth_failed: bool = False
    waiting: dict[str, asyncio.Future[AssembleResponse | ErrorReply | None]] = field(default_factory=dict)
    status_waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)


class AsyncClient:
    """Async client. Use ``async with AsyncClient([...]) as c: await c.assemble(req, timeout=0.05)``."""

    def __init__(self, endpoints: Sequence[str] | str | None = None, *, settings: Settings | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Callable[[zmq.Socket[bytes]], None] | None = None,
                 default_timeout: float = 0.045) -> None:
        settings = settings or Settings()
        if endpoints is None:
            endpoints = settings.endpoints()
        elif isinstance(endpoints, str):
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise ValueError("at least one broker endpoint is required")
        self.endpoints = list(endpoints)
        self.default_timeout = default_timeout
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        if configure_socket is None and settings.client_key_file:
            from shared import auth

            if not settings.broker_public_key:
                raise ValueError("IBEX_CLIENT_KEY_FILE is set but IBEX_BROKER_PUBLIC_KEY is not")
            configure_socket = auth.curve_client(auth.load_keypair(settings.client_key_file),
                                                 auth.load_public_key(settings.broker_public_key))
        self.configure_socket = configure_socket
        self.conns: list[_Conn] = []
        self._rr = itertools.count()
        self.stats: dict[str, int] = {"late_replies_dropped": 0, "failovers": 0, "disconnects": 0}
        self._started = False
        self._closed = False
        self._catalog: Any = None

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for ep in self.endpoints:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to live connections: fail over fast
            sock.setsockopt(zmq.SNDHWM, P.SNDHWM)
            sock.setsockopt(zmq.RCVHWM, P.RCVHWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if self.configure_socket is not None:
                self.configure_socket(sock)
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(ep)
            # Sockets are served by loop callbacks (shared.loopsock), not awaited reads: a reply
            # costs no Future and no task switch on its way to the caller's future.
            conn = _Conn(ep)
            conn.sock = LoopSocket(sock, functools.partial(self._on_reply, conn), name=f"broker {ep}")
            conn.monitor = LoopSocket(mon, functools.partial(self._on_event, conn), name=f"monitor {ep}")
            self.conns.append(conn)

    async def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        """Wait until every endpoint (or, with ``require_all=False``, any) has completed a handshake."""
        await self.start()
        end = time.monotonic() + timeout
        ready = all if require_all else any
        while not ready(c.connected for c in self.conns):
            if time.monotonic() > end:
                down = [c.endpoint for c in self.conns if not c.connected]
                raise Unavailable(f"could not connect to broker(s) {', '.join(down)} within {timeout}s")
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.conns:
            self._fail_all(c, Unavailable("client closed"))
            c.sock.sock.disable_monitor()
            c.monitor.close()
            c.sock.close()
        if self._own_ctx:
            self.ctx.term()

    # ------------------------------------------------------------------------------ readers

    def _on_reply(self, conn: _Conn, frames: list[bytes]) -> None:
        if len(frames) != 4 or frames[0] != P.TAG or frames[1] not in (P.REPLY, P.ERROR):
            log.warning("dropping malformed reply from %s", conn.endpoint)
            return
        rid = frames[2].decode(errors="replace")
        if rid == "" and frames[1] == P.REPLY:  # STATUS answer
            if conn.status_waiters:
                fut = conn.status_waiters.pop(0)
                if not fut.done():
                    fut.set_result(msgpack.unpackb(frames[3]))
            return
        fut_r = conn.waiting.pop(rid, None)
        if fut_r is None or fut_r.done():
            self.stats["late_replies_dropped"] += 1
            return
        fut_r.set_result(decode_reply(frames[3]))

    def _on_event(self, conn: _Conn, msg: list[bytes]) -> None:
        ev = parse_monitor_message(msg)
        if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.connected, conn.auth_failed = True, False
        elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            conn.connected, conn.auth_failed = False, True
            self._fail_all(conn, Unauthenticated(f"broker {conn.endpoint} refused this client's key"))
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            conn.connected = False
            self.stats["disconnects"] += 1
            self._fail_all(conn, Unavailable(f"lost the connection to broker {conn.endpoint}"))

    def _fail_all(self, conn: _Conn, exc: IbexError) -> None:
        waiting, conn.waiting = conn.waiting, {}
        for rid, fut in waiting.items():
            if not fut.done():
                fut.set_result(ErrorReply(request_id=rid, code=exc.code, message=exc.message))

    # ------------------------------------------------------------------------------ calls

    def _pick(self, tried: set[int]) -> _Conn | None:
        n = len(self.conns)
        start = next(self._rr)
        order = [(start + i) % n for i in range(n)]
        for i in order:
            if i not in tried and self.conns[i].connected:
                tried.add(i)
                return self.conns[i]
        for i in order:
            if i not in tried:
                tried.add(i)
                return self.conns[i]
        return None

    async def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                       **fields: Any) -> AssembleResponse:
        """Assemble context; raises a typed ``IbexError`` subclass on any failure.

        Pass an ``AssembleRequest`` or its fields (request_id defaults to a fresh UUID). The deadline
        is stamped here: ``deadline_ns = now + timeout``.
        """
        await self.start()
        timeout = self.default_timeout if timeout is None else timeout
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        t0 = time.monotonic()
        end = t0 + timeout
        rid, payload = _encode_with_deadline(request, fields, time.time_ns() + int(timeout * 1e9))
        loop = asyncio.get_running_loop()
        tried: set[int] = set()
        last: ErrorReply | None = None
        unsent = False  # every attempt so far failed to send (not connected yet, or reconnecting)
        while True:
            conn = self._pick(tried)
            remaining = end - time.monotonic()
            if conn is None and unsent and remaining > MIN_RETRY_S and not all(c.auth_failed for c in self.conns):
                await asyncio.sleep(min(0.005, remaining - MIN_RETRY_S))  # wait for a (re)connect
                tried.clear()
                continue
            if conn is None or remaining <= (MIN_RETRY_S if last else 0):
                break
            fut: asyncio.Future[AssembleResponse | ErrorReply | None] = loop.create_future()
            conn.waiting[rid] = fut
            exc = conn.sock.send([P.TAG, P.REQUEST, payload])
            if exc is not None:  # not connected (IMMEDIATE) or pipe full
                conn.waiting.pop(rid, None)
                last = ErrorReply(request_id=rid, code=ErrorCode.UNAVAILABLE,
                                  message=f"cannot send to broker {conn.endpoint}: {exc}")
                unsent = True
                continue
            # A timer callback, not asyncio.timeout(): no task cancellation machinery per request.
            timer = loop.call_at(loop.time() + remaining, _time_out, fut)
            try:
                reply = await fut
            finally:
                timer.cancel()
                conn.waiting.pop(rid, None)
            if reply is None:
                raise DeadlineExceeded(f"no reply within {timeout * 1000:.1f} ms (client-enforced deadline)",
                                       request_id=rid)
            if time.monotonic() >= end:  # the loop may have stalled past the deadline: nothing late
                raise DeadlineExceeded(f"reply arrived after the {timeout * 1000:.1f} ms deadline",
                                       request_id=rid)
            if isinstance(reply, AssembleResponse):
                return reply
            last, unsent = reply, False
            if reply.code not in RETRYABLE:
                break
            self.stats["failovers"] += 1
        if self.conns and all(c.auth_failed for c in self.conns):
            raise Unauthenticated("every broker refused this client's key (CURVE handshake failed)",
                                  request_id=rid)
        if last is None:
            raise Unavailable("no broker endpoint could take the request", request_id=rid)
        raise _to_exc(last, rid)

    async def assemble_or_degrade(self, request: AssembleRequest | None = None, *,
                                  timeout: float | None = None, fallback_directive: str | None = None,
                                  **fields: Any) -> AssembleResponse:
        """Like ``assemble`` but a service fault returns a degraded history-only response."""
        req = _build(request, fields, time.time_ns())
        try:
            return await self.assemble(req, timeout=timeout)
        except IbexError as exc:
            if exc.code in CALLER_FAULTS:
                raise
            if self._catalog is None:  # loaded on first need: the happy path never pays for it
                from shared.catalog import Catalog

                self._catalog = Catalog.load()
            return degraded_response(req, exc, fallback_directive, catalog=self._catalog)

    async def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        """The broker's counters and worker table (ops and tests)."""
        await self.start()
        conn = next((c for c in self.conns if endpoint in (None, c.endpoint)), None)
        if conn is None:
            raise ValueError(f"unknown endpoint {endpoint}")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.status_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                unsent = conn.sock.send([P.TAG, P.STATUS])
                while unsent is not None:  # not connected yet (IMMEDIATE): try again shortly
                    await asyncio.sleep(0.005)
                    unsent = conn.sock.send([P.TAG, P.STATUS])
                return await fut
        except TimeoutError:
            if fut in conn.status_waiters:
                conn.status_waiters.remove(fut)
            raise Unavailable(f"broker {conn.endpoint} did not answer STATUS within {timeout}s") from None


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def _encode_with_deadline(request: AssembleRequest | None, fields: dict[str, Any],
                          deadline_ns: int) -> tuple[str, bytes]:
    """(request_id, wire payload) with the deadline stamped; a given request is not copied first."""
    if request is None or fields:
        req = _build(request, fields, deadline_ns)  # validates fields; refuses a request plus fields
        return req.request_id, encode(req)
    doc = request.model_dump(mode="python")
    doc["deadline_ns"] = deadline_ns
    return request.request_id, msgpack.packb(doc, use_bin_type=True)


def _build(request: AssembleRequest | None, fields: dict[str, Any], deadline_ns: int) -> AssembleRequest:
    if request is not None and fields:
        raise TypeError("pass either an AssembleRequest or its fields, not both")
    if request is None:
        fields = {"request_id": uuid.uuid4().hex, **fields, "deadline_ns": deadline_ns}
        return AssembleRequest.model_validate(fields)
    return request.model_copy(update={"deadline_ns": deadline_ns})


def _to_exc(reply: ErrorReply, request_id: str) -> IbexError:
    cls = ERROR_BY_CODE.get(reply.code, Internal)
    return cls(reply.message, field=reply.field, request_id=request_id)


def degraded_response(req: AssembleRequest, exc: IbexError, fallback_directive: str | None = None,
                      *, catalog: Any = None) -> AssembleResponse:
    """History-only (or directive + history) context built locally by the pure pipeline."""
    from shared.catalog import Catalog
    from worker.assemble import Assembler
    from worker.retrieve import RetrievalResult

    failed = BranchOutcome(status="error", elapsed_ms=0.0, error_class=exc.code.value, detail=exc.message[:200])
    retrieval = RetrievalResult(
        directive=fallback_directive, directive_version=None, hot=(), cold=(), candidates=(), rejections=(),
        outcomes={"directive": failed, "hot": failed, "cold": failed},
        sources_available=frozenset(), wall_ms=0.0,
    )
    assembler = Assembler(settings=Settings(), catalog=catalog or Catalog.load(), retriever=None)
    resp = assembler.build_response(req, retrieval)
    reason = f"context service {exc.code.value}: {exc.message}"
    return resp.model_copy(update={"degraded": True, "degraded_reasons": [reason, *resp.degraded_reasons]})


class SyncClient:
    """Blocking client for threaded callers; runs an ``AsyncClient`` on a private loop thread."""

    def __init__(self, endpoints: Sequence[str] | str | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ibex-client", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(endpoints, kwargs))

    async def _make(self, endpoints: Sequence[str] | str | None, kwargs: dict[str, Any]) -> AsyncClient:
        c = AsyncClient(endpoints, **kwargs)
        await c.start()
        return c

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                 **fields: Any) -> AssembleResponse:
        return self._call(self._client.assemble(request, timeout=timeout, **fields))

    def assemble_or_degrade(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                            **fields: Any) -> AssembleResponse:
        return self._call(self._client.assemble_or_degrade(request, timeout=timeout, **fields))

    def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        return self._call(self._client.status(endpoint, timeout))

    def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        self._call(self._client.wait_connected(timeout, require_all=require_all))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
