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
  What the fallback needs (catalog, tokenizers, the pipeline's modules) is loaded by ``start()`` on
  a thread, so the first fallback never stalls the caller's event loop for the ~1 s that takes.
* Every caller mistake is an ``InvalidRequest`` naming the field, raised before anything is sent:
  bad fields or timeout, text that is not UTF-8, a payload over ``IBEX_MAX_REQUEST_BYTES`` (the
  broker would drop the whole connection, failing every request in flight on it), a malformed
  endpoint, and any use after ``close()`` (``ClientClosed``). README: The client library.

Thread safety: ``AsyncClient`` belongs to the event loop that first uses it and is safe to share
across tasks on that loop. ``SyncClient`` runs its own loop on a background thread and is safe to
share across threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import itertools
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import zmq
from pydantic import ValidationError
from zmq.utils.monitor import parse_monitor_message

from ibex_context.shared import protocol as P
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.codec import decode_reply, validate
from ibex_context.shared.errors import (
    ERROR_BY_CODE,
    DeadlineExceeded,
    ErrorCode,
    IbexError,
    Internal,
    InvalidRequest,
    Unauthenticated,
    Unavailable,
)
from ibex_context.shared.loopsock import LoopSocket
from ibex_context.shared.models import AssembleRequest, AssembleResponse, BranchOutcome, ErrorReply
from ibex_context.shared.settings import Settings

log = logging.getLogger(__name__)

RETRYABLE = {ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.UNAUTHENTICATED}
CALLER_FAULTS = {ErrorCode.INVALID_REQUEST, ErrorCode.FORBIDDEN, ErrorCode.UNAUTHENTICATED}
MIN_RETRY_S = 0.002
# Longest timeout a call accepts: anything longer is a unit mistake (milliseconds passed as seconds),
# and it keeps deadline_ns inside the wire's 64-bit integer.
MAX_TIMEOUT_S = 3600.0
# Modules the degraded response imports (see degraded_response); start() imports them off the loop.
FALLBACK_MODULES = ("ibex_context.worker.assemble", "ibex_context.worker.retrieve")
ENDPOINT_FORMS = "tcp://host:port, ipc://path or inproc://name"
_TCP_HOST = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]")
T = TypeVar("T")


class ClientClosed(InvalidRequest):
    """The client was closed: a call after ``close()``/``aclose()`` is a caller bug, so it raises
    (``assemble_or_degrade`` too: degrading would hide the bug)."""


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
    """Async client. Use ``async with AsyncClient([...]) as c: await c.assemble(req, timeout=0.05)``.

    ``default_timeout`` (seconds) applies when a call gives none; unset, it is
    ``IBEX_CONTEXT_TIMEOUT`` (milliseconds) from the settings. Endpoints default to
    ``IBEX_BROKER_ENDPOINTS``. Bad arguments raise ``InvalidRequest`` naming the argument.
    """

    def __init__(self, endpoints: Sequence[str] | str | None = None, *, settings: Settings | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Callable[[zmq.Socket[bytes]], None] | None = None,
                 default_timeout: float | None = None) -> None:
        settings = settings or _load_settings()
        self.settings = settings
        self.endpoints = _parse_endpoints(settings.broker_endpoints if endpoints is None else endpoints)
        self.default_timeout = _check_timeout(
            settings.context_timeout_ms / 1000 if default_timeout is None else default_timeout, "default_timeout")
        self.max_request_bytes = settings.max_request_bytes
        if configure_socket is None and settings.client_key_file:
            from ibex_context.shared import auth

            if not settings.broker_public_key:
                raise InvalidRequest("IBEX_CLIENT_KEY_FILE is set but IBEX_BROKER_PUBLIC_KEY is not",
                                     field="broker_public_key")
            configure_socket = auth.curve_client(auth.load_keypair(settings.client_key_file),
                                                 auth.load_public_key(settings.broker_public_key))
        self.configure_socket = configure_socket
        self._own_ctx = ctx is None
        # Made by start(): a client that is refused, or built and never used, holds no resources.
        self.ctx: zmq.Context[zmq.Socket[bytes]] | None = ctx
        self.conns: list[_Conn] = []
        self._rr = itertools.count()
        self.stats: dict[str, int] = {"late_replies_dropped": 0, "failovers": 0, "disconnects": 0}
        self._started = False
        self._closed = False
        self._fallback: asyncio.Future[Catalog | Exception] | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("client is closed: create a new client (this one's sockets are gone)",
                               field="client")

    async def start(self) -> None:
        """Connect the sockets and begin loading the fallback on a thread (idempotent)."""
        self._check_open()
        if self._started:
            return
        self._started = True
        # The fallback's catalog, BPE vocabularies and pipeline modules take ~1 s to load; on the
        # loop that is a ~1 s stall of every request the proxy is serving (README: The client library).
        self._fallback = asyncio.get_running_loop().run_in_executor(None, _prepare_fallback, self.settings)
        if self.ctx is None:
            self.ctx = zmq.Context()
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

    async def prepare_fallback(self) -> Catalog:
        """Wait (without blocking the loop) until the fallback's catalog and tokenizers are loaded.

        ``start()`` began loading them; a proxy may await this before taking traffic so that even
        its first fallback is fast. Raises ``Internal`` when the catalog cannot be loaded.
        """
        await self.start()
        if self._fallback is None:  # pragma: no cover - start() sets it before its first await
            raise Internal("the client's fallback was never started")
        loaded = await asyncio.shield(self._fallback)  # a cancelled caller must not cancel the load
        if isinstance(loaded, Exception):
            raise Internal(f"the fallback cannot load the model catalog: {loaded}") from loaded
        return loaded

    async def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        """Wait until every endpoint (or, with ``require_all=False``, any) has completed a handshake."""
        timeout = _check_timeout(timeout, "timeout")
        await self.start()
        end = time.monotonic() + timeout
        ready = all if require_all else any
        while not ready(c.connected for c in self.conns):
            self._check_open()
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
            for fut in c.status_waiters:
                fut.cancel()
            c.sock.sock.disable_monitor()
            c.monitor.close()
            c.sock.close()
        if self._own_ctx and self.ctx is not None:
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

    def _encode(self, request: AssembleRequest | None, fields: dict[str, Any], deadline_ns: int) -> tuple[str, bytes]:
        """(request_id, payload), refused here when over the size limit.

        The broker's ZMQ_MAXMSGSIZE drops the whole connection on an oversized message, failing
        every request in flight on it; only the client can keep one big request from doing that.
        """
        rid, payload = _encode_with_deadline(request, fields, deadline_ns)
        if len(payload) > self.max_request_bytes:
            raise InvalidRequest(f"request payload is {len(payload)} bytes, over the limit of {self.max_request_bytes} "
                                 "bytes (IBEX_MAX_REQUEST_BYTES); shorten recent_messages or tool_schemas",
                                 field="<payload>", request_id=rid)
        return rid, payload

    async def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                       **fields: Any) -> AssembleResponse:
        """Assemble context; raises a typed ``IbexError`` subclass on any failure.

        Pass an ``AssembleRequest`` or its fields (request_id defaults to a fresh UUID). The deadline
        is stamped here: ``deadline_ns = now + timeout``. Caller mistakes raise ``InvalidRequest``
        (``.field`` names the field) before anything is sent.
        """
        self._check_open()
        timeout = self.default_timeout if timeout is None else _check_timeout(timeout, "timeout")
        rid, payload = self._encode(request, fields, time.time_ns() + int(timeout * 1e9))
        await self.start()
        t0 = time.monotonic()
        end = t0 + timeout
        loop = asyncio.get_running_loop()
        tried: set[int] = set()
        last: ErrorReply | None = None
        unsent = False  # every attempt so far failed to send (not connected yet, or reconnecting)
        while True:
            self._check_open()
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
            self._check_open()  # closed while in flight: say so, not "unavailable"
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
        """Like ``assemble`` but a service fault returns a degraded history-only response.

        Caller faults (``InvalidRequest`` and its ``ClientClosed``, ``Forbidden``,
        ``Unauthenticated``) still raise: degrading would hide the caller's bug.
        """
        self._check_open()
        if fallback_directive is not None and not isinstance(fallback_directive, str):
            raise InvalidRequest(f"fallback_directive must be a str or None, got {type(fallback_directive).__name__}",
                                 field="fallback_directive")
        req = _build(request, fields, time.time_ns())
        try:
            return await self.assemble(req, timeout=timeout)
        except IbexError as exc:
            if exc.code in CALLER_FAULTS:
                raise
            failure = exc
        return await self._degrade(req, failure, fallback_directive)

    async def _degrade(self, req: AssembleRequest, exc: IbexError, fallback_directive: str | None) -> AssembleResponse:
        """The degraded response, after the checks the worker would have made (an outage skipped them)."""
        catalog = await self.prepare_fallback()
        checked = validate(req.model_dump(mode="python"), AssembleRequest)  # e.g. NaN inside tool_schemas
        if isinstance(checked, ErrorReply):
            raise _to_exc(checked, req.request_id)
        return degraded_response(req, exc, fallback_directive, catalog=catalog, settings=self.settings)

    async def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        """The broker's counters and worker table (ops and tests)."""
        self._check_open()
        timeout = _check_timeout(timeout, "timeout")
        await self.start()
        conn = next((c for c in self.conns if endpoint in (None, c.endpoint)), None)
        if conn is None:
            raise InvalidRequest(f"endpoint {endpoint!r} is not one of this client's endpoints", field="endpoint")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.status_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                unsent = conn.sock.send([P.TAG, P.STATUS])
                while unsent is not None:  # not connected yet (IMMEDIATE): try again shortly
                    await asyncio.sleep(0.005)
                    self._check_open()
                    unsent = conn.sock.send([P.TAG, P.STATUS])
                return await fut
        except TimeoutError:
            if fut in conn.status_waiters:
                conn.status_waiters.remove(fut)
            raise Unavailable(f"broker {conn.endpoint} did not answer STATUS within {timeout}s") from None
        except asyncio.CancelledError:
            if self._closed and fut.cancelled():  # aclose() cancelled the waiter, not our caller
                raise ClientClosed("client closed while waiting for STATUS", field="client") from None
            raise


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def _load_settings() -> Settings:
    """Settings from the environment; a bad ``IBEX_*`` value is an ``InvalidRequest`` naming it."""
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "<settings>"
        raise InvalidRequest(f"setting {name}: {first['msg']}", field=name) from None


def _check_timeout(value: object, name: str) -> float:
    """A timeout in seconds: a finite number in (0, MAX_TIMEOUT_S]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number of seconds, got {type(value).__name__}", field=name)
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequest(f"{name} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}",
                             field=name)
    return float(value)


def _parse_endpoints(value: object) -> list[str]:
    """A comma-separated string or a sequence of ZeroMQ endpoints, each checked; at least one."""
    if isinstance(value, str):
        found = [e.strip() for e in value.split(",") if e.strip()]
    elif isinstance(value, list | tuple):
        found = list(value)
    else:
        raise InvalidRequest(f"endpoints must be a str or a list of str, got {type(value).__name__}",
                             field="endpoints")
    if not found:
        raise InvalidRequest(f"endpoints: at least one broker endpoint ({ENDPOINT_FORMS}) is required",
                             field="endpoints")
    for ep in found:
        if not isinstance(ep, str) or not _endpoint_ok(ep):
            raise InvalidRequest(f"endpoints: {ep!r} is not a broker endpoint ({ENDPOINT_FORMS})", field="endpoints")
    return found


def _endpoint_ok(ep: str) -> bool:
    """Whether libzmq can connect to ``ep`` as written: tcp with a host and a port, ipc, inproc.

    The ``tcp://source;host:port`` form and wildcard hosts are refused: they are bind syntax.
    """
    if ep.startswith(("ipc://", "inproc://")):
        rest = ep.partition("://")[2]
        return bool(rest) and rest.isprintable() and not rest.isspace()
    if not ep.startswith("tcp://"):
        return False
    host, sep, port = ep[len("tcp://"):].rpartition(":")
    return (bool(sep) and _TCP_HOST.fullmatch(host) is not None and port.isascii() and port.isdigit()
            and 0 < int(port) < 65536)


# pydantic messages that would not tell a caller what to fix, in words that do.
_PLAIN_REASONS = {
    "extra_forbidden": "not an AssembleRequest field",
    "string_unicode": "text is not valid UTF-8 (it holds a lone surrogate)",
}


def _invalid_fields(exc: ValidationError, request_id: str | None = None) -> InvalidRequest:
    """The first pydantic error as one line naming its field (as the worker's codec names it)."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "<root>"
    why = _PLAIN_REASONS.get(first["type"], first["msg"])
    more = exc.error_count() - 1
    message = f"{field}: {why}"[:300].replace("\n", " ") + (f" (+{more} more)" if more else "")
    return InvalidRequest(message, field=field, request_id=request_id)


def _pack(doc: dict[str, Any], request_id: str) -> bytes:
    """msgpack a request document; a value msgpack refuses is an ``InvalidRequest`` naming its path."""
    try:
        return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError) as exc:
        path, why = _first_unpackable(doc) or ("<payload>", f"cannot be encoded ({type(exc).__name__})")
        raise InvalidRequest(f"{path}: {why}", field=path, request_id=request_id) from None


def _first_unpackable(obj: Any, path: str = "") -> tuple[str, str] | None:
    """(path, why) of the first value msgpack cannot carry: text that is not UTF-8 (a lone
    surrogate), an integer outside 64 bits, a type msgpack has no form for."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        cur, p = stack.pop()
        where = p or "<root>"
        if isinstance(cur, str):
            try:
                cur.encode("utf-8")
            except UnicodeEncodeError:
                return where, "text is not valid UTF-8 (it holds a lone surrogate)"
        elif isinstance(cur, bool) or cur is None or isinstance(cur, float | bytes | bytearray):
            continue
        elif isinstance(cur, int):
            if not -(1 << 63) <= cur < (1 << 64):
                return where, "integer does not fit in 64 bits"
        elif isinstance(cur, dict):
            for k, v in reversed(cur.items()):
                if not isinstance(k, str):
                    return where, "map keys must be strings"
                stack.append((k, where))
                stack.append((v, f"{p}.{k}" if p else k))
        elif isinstance(cur, list | tuple):
            stack.extend((v, f"{p}[{i}]") for i, v in reversed(list(enumerate(cur))))
        else:
            return where, f"a {type(cur).__name__} cannot be sent (JSON-like values only)"
    return None


def _encode_with_deadline(request: AssembleRequest | None, fields: dict[str, Any],
                          deadline_ns: int) -> tuple[str, bytes]:
    """(request_id, wire payload) with the deadline stamped; a given request is not copied first."""
    if request is None or fields:
        req = _build(request, fields, deadline_ns)  # validates fields; refuses a request plus fields
        return req.request_id, _pack(req.model_dump(mode="python"), req.request_id)
    if not isinstance(request, AssembleRequest):
        raise InvalidRequest(f"request must be an AssembleRequest, got {type(request).__name__}", field="request")
    doc = request.model_dump(mode="python")
    doc["deadline_ns"] = deadline_ns
    return request.request_id, _pack(doc, request.request_id)


def _build(request: AssembleRequest | None, fields: dict[str, Any], deadline_ns: int) -> AssembleRequest:
    """A validated request from an ``AssembleRequest`` or from fields; mistakes are ``InvalidRequest``."""
    if request is not None and fields:
        raise InvalidRequest(f"pass either an AssembleRequest or its fields, not both (got {', '.join(fields)})",
                             field="request")
    if request is None:
        rid = fields.get("request_id")
        try:
            return AssembleRequest.model_validate(
                {"request_id": uuid.uuid4().hex, **fields, "deadline_ns": deadline_ns})
        except ValidationError as exc:
            raise _invalid_fields(exc, rid if isinstance(rid, str) else None) from None
    if not isinstance(request, AssembleRequest):
        raise InvalidRequest(f"request must be an AssembleRequest, got {type(request).__name__}", field="request")
    return request.model_copy(update={"deadline_ns": deadline_ns})


def _to_exc(reply: ErrorReply, request_id: str) -> IbexError:
    cls = ERROR_BY_CODE.get(reply.code, Internal)
    return cls(reply.message, field=reply.field, request_id=request_id)


def _prepare_fallback(settings: Settings) -> Catalog | Exception:
    """Load what ``degraded_response`` needs (thread, from ``start()``); a failure is returned,
    not raised, so it reaches the first fallback instead of an unretrieved-exception warning."""
    try:
        for name in FALLBACK_MODULES:
            importlib.import_module(name)
        catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries)
        catalog.warm_up()
        return catalog
    except Exception as exc:
        log.warning("the client's fallback could not load: %s", exc)
        return exc


def degraded_response(req: AssembleRequest, exc: IbexError, fallback_directive: str | None = None,
                      *, catalog: Any = None, settings: Settings | None = None) -> AssembleResponse:
    """History-only (or directive + history) context built locally by the pure pipeline."""
    from ibex_context.worker.assemble import Assembler
    from ibex_context.worker.retrieve import RetrievalResult

    failed = BranchOutcome(status="error", elapsed_ms=0.0, error_class=exc.code.value, detail=exc.message[:200])
    retrieval = RetrievalResult(
        directive=fallback_directive, directive_version=None, hot=(), cold=(), candidates=(), rejections=(),
        outcomes={"directive": failed, "hot": failed, "cold": failed},
        sources_available=frozenset(), wall_ms=0.0,
    )
    assembler = Assembler(settings=settings or Settings(), catalog=catalog or Catalog.load(), retriever=None)
    resp = assembler.build_response(req, retrieval)
    reason = f"context service {exc.code.value}: {exc.message}"
    return resp.model_copy(update={"degraded": True, "degraded_reasons": [reason, *resp.degraded_reasons]})


class SyncClient:
    """Blocking client for threaded callers; runs an ``AsyncClient`` on a private loop thread.

    Arguments are checked (``InvalidRequest``) before the thread starts. After ``close()`` every
    call raises ``ClientClosed``; calls in flight at ``close()`` end with it too.
    """

    def __init__(self, endpoints: Sequence[str] | str | None = None, **kwargs: Any) -> None:
        self._client = AsyncClient(endpoints, **kwargs)
        self._lock = threading.Lock()  # orders submissions against close()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ibex-client", daemon=True)
        self._thread.start()
        self._call(self._client.start)

    def _call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the client's loop; the coroutine is created only once it will be run."""
        with self._lock:
            if self._closed:
                raise ClientClosed("client is closed: create a new client", field="client")
            fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(make(), self._loop)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise ClientClosed("client closed while the call was in flight", field="client") from None
            raise

    def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                 **fields: Any) -> AssembleResponse:
        return self._call(lambda: self._client.assemble(request, timeout=timeout, **fields))

    def assemble_or_degrade(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                            fallback_directive: str | None = None, **fields: Any) -> AssembleResponse:
        return self._call(lambda: self._client.assemble_or_degrade(
            request, timeout=timeout, fallback_directive=fallback_directive, **fields))

    def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        return self._call(lambda: self._client.status(endpoint, timeout))

    def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        self._call(lambda: self._client.wait_connected(timeout, require_all=require_all))

    def prepare_fallback(self) -> None:
        """Block until the fallback is loaded (see ``AsyncClient.prepare_fallback``)."""
        self._call(self._client.prepare_fallback)

    @property
    def stats(self) -> dict[str, int]:
        return self._client.stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Close the client and let every call still on the loop finish (with ``ClientClosed``)."""
        await self._client.aclose()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
