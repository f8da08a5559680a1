"""The proxy's client library: the asyncio client over ZeroMQ DEALER sockets (``client.sync`` wraps
it for threads).

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
  endpoint, and any use after ``close()`` (``ClientClosed``). README "The client library".
* A chat conversation's images travel as their size and digest, and a reply as a layout over the
  caller's own conversation, which the client rebuilds (``client.wire``; docs/assembly.md "Size limits").

Thread safety: ``AsyncClient`` belongs to the event loop that first uses it and is safe to share
across tasks on that loop. ``SyncClient`` runs its own loop on a background thread and is safe to
share across threads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..pipeline.budget.catalog import Catalog
from ..shared.config.settings import ClientSettings
from ..shared.wire import protocol as P
from ..shared.wire.codec import decode_reply
from ..shared.wire.errors import (
    DeadlineExceeded,
    ErrorCode,
    IbexError,
    Internal,
    InvalidRequest,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from ..shared.wire.models import AssembleRequest, AssembleResponse, ErrorReply
from .connection import Conn, failure, open_conn, pick, time_out, too_short
from .degrade import COPY_ENTRIES, DirectiveCopies, Fallback, degraded_response
from .requests import (  # ClientClosed is part of this module's API
    ClientClosed,
    build,
    check_timeout,
    encode_request,
    load_settings,
    parse_endpoints,
)
from .throttle import Throttle
from .usage import USAGE_ID_PREFIX, summary_payload, usage_payload
from .wire import Outgoing, outgoing, scaled_timeout, too_large

log = logging.getLogger(__name__)

__all__ = ["AsyncClient", "ClientClosed", "degraded_response"]

RETRYABLE = {ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.UNAUTHENTICATED}
# Faults of the request itself: a degraded response would not cure them (an overflowing
# conversation overflows the local fallback too), so assemble_or_degrade raises them.
CALLER_FAULTS = {ErrorCode.INVALID_REQUEST, ErrorCode.FORBIDDEN, ErrorCode.UNAUTHENTICATED,
                 ErrorCode.CONTEXT_OVERFLOW}
MIN_RETRY_S = 0.002


class AsyncClient:
    """Async client. Use ``async with AsyncClient([...]) as c: await c.assemble(req, timeout=0.05)``.

    ``default_timeout`` (seconds) applies when a call gives none; unset, it is
    ``IBEX_CLIENT_TIMEOUT_MS`` grown with the conversation (``call_timeout``). Endpoints default to
    ``IBEX_BROKER_ENDPOINTS``. Bad arguments raise ``InvalidRequest`` naming the argument.
    """

    def __init__(self, endpoints: Sequence[str] | str | None = None, *, settings: ClientSettings | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Callable[[zmq.Socket[bytes]], None] | None = None,
                 default_timeout: float | None = None, directive_copies: bool = True) -> None:
        settings = settings or load_settings()
        self.settings = settings
        self.endpoints = parse_endpoints(settings.broker_endpoints if endpoints is None else endpoints)
        self.default_timeout = check_timeout(
            settings.client_timeout_ms / 1000 if default_timeout is None else default_timeout, "default_timeout")
        self.max_request_bytes = settings.max_request_bytes
        if configure_socket is None and settings.client_key_file:
            from ..shared.security import auth

            try:
                configure_socket = auth.curve_client_for(settings.client_key_file, settings, role="client")
            except auth.MissingBrokerKey as exc:
                raise InvalidRequest(str(exc), field="broker_public_key") from None
        self.configure_socket = configure_socket
        self._own_ctx = ctx is None
        # Made by start(): a client that is refused, or built and never used, holds no resources.
        self.ctx: zmq.Context[zmq.Socket[bytes]] | None = ctx
        self.conns: list[Conn] = []
        self._rr = itertools.count()
        self.stats: dict[str, int] = {"late_replies_dropped": 0, "failovers": 0, "disconnects": 0,
                                      "usage_sent": 0, "usage_not_sent": 0, "usage_refused": 0}
        self._started = False
        self._started_at = 0.0  # time.monotonic() of start()
        self._closed = False
        self._fallback: Fallback | None = None
        self._directives = DirectiveCopies(entries=COPY_ENTRIES if directive_copies else 0)  # for the fallback
        self._throttle = Throttle(settings.client_throttle_k, settings.client_throttle_window_s,
                                  min_rps=settings.client_throttle_min_rps)

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
        self._started_at = time.monotonic()
        # The fallback's catalog, BPE vocabularies and pipeline modules take ~1 s to load; on the
        # loop that is a ~1 s stall of every request the proxy is serving (README "The client library").
        self._fallback = Fallback(asyncio.get_running_loop(), self.settings)
        if self.ctx is None:
            self.ctx = zmq.Context()
        for ep in self.endpoints:
            conn = open_conn(self.ctx, ep, self.configure_socket, self._on_reply, self._on_event)
            self.conns.append(conn)

    async def prepare_fallback(self) -> Catalog:
        """Wait (without blocking the loop) until the fallback's catalog and tokenizers are loaded.

        ``start()`` began loading them; a proxy may await this before taking traffic so that even
        its first fallback is fast. Raises ``Internal`` when the catalog cannot be loaded.
        """
        await self.start()
        if self._fallback is None:  # pragma: no cover - start() sets it before its first await
            raise Internal("the client's fallback was never started")
        return await self._fallback.ready()

    async def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        """Wait until every endpoint (or, with ``require_all=False``, any) has completed a handshake."""
        timeout = check_timeout(timeout, "timeout")
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
            c.fail_all(Unavailable("client closed"))
            for fut in c.status_waiters:
                fut.cancel()
            c.close()
        if self._own_ctx and self.ctx is not None:
            self.ctx.term()

    # ------------------------------------------------------------------------------ readers

    def _on_reply(self, conn: Conn, frames: list[bytes]) -> None:
        try:
            reply = P.parse_reply(frames)
        except P.FrameError as exc:
            log.warning("dropping malformed reply from %s: %s", conn.endpoint, exc)
            return
        if isinstance(reply, P.StatusReply):
            if conn.status_waiters:
                fut = conn.status_waiters.pop(0)
                if not fut.done():
                    fut.set_result(reply.snapshot)
            return
        fut_r = conn.waiting.pop(reply.correlation_id, None)
        if fut_r is None and reply.correlation_id.startswith(USAGE_ID_PREFIX):  # nobody waits for a report
            self.stats["usage_refused"] += 1
            log.warning("usage report refused by broker %s: %s", conn.endpoint, decode_reply(reply.payload))
            return
        if fut_r is None or fut_r.done():
            self.stats["late_replies_dropped"] += 1
            return
        fut_r.set_result(decode_reply(reply.payload))

    def _on_event(self, conn: Conn, msg: list[bytes]) -> None:
        ev = parse_monitor_message(msg)
        if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.connected, conn.auth_failed, conn.refused = True, False, False
        elif ev["event"] == zmq.EVENT_CONNECT_RETRIED:
            conn.refused = True
        elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            conn.connected, conn.auth_failed = False, True
            conn.fail_all(Unauthenticated(f"broker {conn.endpoint} refused this client's key"))
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            conn.connected = False
            self.stats["disconnects"] += 1
            conn.fail_all(Unavailable(f"lost the connection to broker {conn.endpoint}"))

    # ------------------------------------------------------------------------------ calls

    def _pick(self, tried: set[int]) -> Conn | None:
        return pick(self.conns, next(self._rr), tried)

    def call_timeout(self, request: AssembleRequest) -> float:
        """The timeout (seconds) of a call that gives none (``client.wire.scaled_timeout``)."""
        return scaled_timeout(request, self.default_timeout, self.settings)

    def _encode(self, request: AssembleRequest | None, fields: dict[str, Any],
                timeout: object) -> tuple[Outgoing, list[bytes], float, float]:
        """(the call's request as made and as sent, its frames, its timeout in seconds: ``timeout``,
        else ``call_timeout``'s, and its end on this process's monotonic clock); the deadline is
        stamped now, and the end is read at the same instant, so a reply is never handed back later
        than the deadline the request carries, however long encoding or a stalled loop took. A
        payload over the size limit is refused here: the broker's ZMQ_MAXMSGSIZE would drop the whole
        connection, failing every request in flight on it, and only the client can keep one big
        request from doing that."""
        seconds = self.default_timeout if timeout is None else check_timeout(timeout, "timeout")
        now_ns, now_s = time.time_ns(), time.monotonic()
        out = outgoing(build(request, fields, now_ns + int(seconds * 1e9)))  # images as stubs (client.wire)
        if timeout is None:
            seconds = self.call_timeout(out.sent)
        _, header, payload = encode_request(out.sent, {}, now_ns + int(seconds * 1e9))
        if len(payload) > self.max_request_bytes:
            raise too_large(out.sent, len(payload), self.max_request_bytes)
        return out, P.request_frames(header, payload), seconds, now_s + seconds

    async def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                       **fields: Any) -> AssembleResponse:
        """Assemble context; raises a typed ``IbexError`` subclass on any failure.

        Pass an ``AssembleRequest`` or its fields (request_id defaults to a fresh UUID). The deadline
        is stamped here: ``deadline_ns = now + timeout``. Caller mistakes raise ``InvalidRequest``
        (``.field`` names the field) before anything is sent.
        """
        self._check_open()
        out, frames, seconds, end = self._encode(request, fields, timeout)
        resp = await self._throttled(out.sent.org_id, out.sent.request_id, frames, seconds, end)
        self._directives.keep(out.sent, resp)
        return out.restore(resp)

    async def _throttled(self, org: str, rid: str, frames: list[bytes], timeout: float,
                         end: float) -> AssembleResponse:
        """``_send`` behind the client's adaptive throttle (``client.throttle``): refused here, at
        once and typed, while the service refuses most of ``org``'s calls."""
        throttle = self._throttle
        if not throttle.admit(org, time.monotonic()):
            self._count("throttled")
            raise Overloaded(f"refused by this client's adaptive throttle: the service refused most of org {org!r}'s "
                             f"calls in the last {self.settings.client_throttle_window_s:g} s", request_id=rid)
        try:
            resp = await self._send(rid, frames, timeout, end)
        except IbexError as exc:
            throttle.answered(org, time.monotonic(), accepted=exc.code is not ErrorCode.OVERLOADED)
            raise
        throttle.answered(org, time.monotonic(), accepted=True)
        return resp

    async def _send(self, rid: str, frames: list[bytes], timeout: float, end: float) -> AssembleResponse:
        """The reply to ``frames``, from the first broker that answers by ``end`` (monotonic; failing over)."""
        await self.start()
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
            reply, sent = await self._attempt(conn, rid, frames, remaining, end, timeout)
            if isinstance(reply, AssembleResponse):
                return reply
            if not sent:
                last, unsent = reply, True
                continue
            self._check_open()  # closed while in flight: say so, not "unavailable"
            last, unsent = reply, False
            if reply.code not in RETRYABLE:
                break
            self.stats["failovers"] += 1
        if last is None or unsent:
            short = too_short(self.conns, last is None, timeout, time.monotonic() - self._started_at, rid)
            if short is not None:
                raise short
        raise failure(self.conns, last, rid)

    async def _attempt(self, conn: Conn, rid: str, frames: list[bytes], remaining: float, end: float,
                       timeout: float) -> tuple[AssembleResponse | ErrorReply, bool]:
        """One try on one broker: (its answer, whether the request was sent). No answer by the
        deadline, or one that arrives after it, is ``DeadlineExceeded``: nothing late is handed back.
        The reply is matched by this attempt's own correlation id, never by ``rid`` (``Conn.send``)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[AssembleResponse | ErrorReply | None] = loop.create_future()
        key, exc = conn.send(frames, fut)
        if exc is not None:  # not connected (IMMEDIATE) or pipe full
            return ErrorReply(request_id=rid, code=ErrorCode.UNAVAILABLE,
                              message=f"cannot send to broker {conn.endpoint}: {exc}"), False
        # A timer callback, not asyncio.timeout(): no task cancellation machinery per request.
        timer = loop.call_at(loop.time() + remaining, time_out, fut)
        try:
            reply = await fut
        finally:
            timer.cancel()
            conn.waiting.pop(key, None)
        if reply is None:
            raise DeadlineExceeded(f"no reply within {timeout * 1000:.1f} ms (client-enforced deadline)",
                                   request_id=rid)
        if time.monotonic() >= end:  # the loop may have stalled past the deadline: nothing late
            raise DeadlineExceeded(f"reply arrived after the {timeout * 1000:.1f} ms deadline",
                                   request_id=rid)
        return reply, True

    def report_usage(self, assembly: AssembleResponse, *, prompt_tokens: int,
                     cached_tokens: int | None = None) -> None:
        """Fire-and-forget: never raises (bad input is logged and counted), never blocks.

        Carries the provider's count for a chat-native assembly back to the service (docs/assembly.md
        "Calibrated token counts"): ``prompt_tokens`` is the whole prompt as the window sees it
        (OpenAI ``usage.prompt_tokens``; Anthropic ``input_tokens`` + ``cache_read_input_tokens`` +
        ``cache_creation_input_tokens``), ``cached_tokens`` the part served from the provider's cache.
        Call it on the client's event loop (``SyncClient.report_usage`` from any thread).
        """
        try:
            payload, why = usage_payload(assembly, prompt_tokens, cached_tokens, time.time_ns())
            self._fire(payload, why, P.USAGE, "usage")
        except Exception:  # fire-and-forget: a bug here must not fail the proxy's call
            self._count("usage_not_sent")
            log.exception("usage report failed")

    def report_summary(self, *, org_id: str, agent_id: str, summary_key: str, text: str, covers: int,
                       as_memory: bool = False, ttl_s: int | None = None, made_at: float | None = None) -> bool:
        """Fire-and-forget: send a compaction summary to be stored under the conversation's
        ``summary_key`` (kept only if ``covers`` is more than the stored one's; with ``as_memory``
        also one of the agent's memories). Whether it was sent; never raises, never blocks (bad
        input is logged and counted in ``summary_not_sent``). Call it on the client's event loop."""
        try:
            payload, why = summary_payload({"org_id": org_id, "agent_id": agent_id, "summary_key": summary_key,
                                            "text": text, "covers": covers, "as_memory": as_memory, "ttl_s": ttl_s,
                                            "made_at": made_at}, time.time_ns())
            return self._fire(payload, why, P.SUMMARY, "summary")
        except Exception:  # fire-and-forget: a bug here must not fail the caller
            self._count("summary_not_sent")
            log.exception("summary report failed")
            return False

    def _fire(self, payload: bytes | None, why: str, cmd: bytes, kind: str) -> bool:
        """Send a report (USAGE or SUMMARY) on any connection without waiting for a reply; whether
        it went. ``kind``'s ``_sent``/``_not_sent`` counter says so, and a report not sent is logged
        with why (``why``: the payload's own problem, else the client's state)."""
        conn = None if payload is None or self._closed or not self._started else self._pick(set())
        if payload is None or conn is None or conn.sock.send(P.usage_frames(payload, cmd)) is not None:
            why = why or ("the client is closed" if self._closed else "the client is not started" if not
                          self._started else "no broker connection could take it")
            self._count(f"{kind}_not_sent")
            log.warning("%s not sent: %s", "usage report" if cmd == P.USAGE else "summary", why)
            return False
        self._count(f"{kind}_sent")
        return True

    def _count(self, name: str) -> None:
        self.stats[name] = self.stats.get(name, 0) + 1

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
        out, frames, seconds, end = self._encode(request, fields, timeout)
        try:
            resp = await self._throttled(out.sent.org_id, out.sent.request_id, frames, seconds, end)
            self._directives.keep(out.sent, resp)
            return out.restore(resp)
        except IbexError as exc:
            if exc.code in CALLER_FAULTS:
                raise
            failure = exc
        return out.restore(await self._degrade(out.sent, failure, fallback_directive, end))

    async def _degrade(self, req: AssembleRequest, exc: IbexError, fallback_directive: str | None,
                       end: float) -> AssembleResponse:
        """The degraded response by ``end`` (``Fallback.respond``) to the request as sent."""
        if self._fallback is None:  # pragma: no cover - _send() started the client before any service fault
            raise Internal("the client's fallback was never started")
        return await self._fallback.respond(req, exc, fallback_directive, end, self._directives)

    async def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        """The broker's counters and worker table (ops and tests)."""
        self._check_open()
        timeout = check_timeout(timeout, "timeout")
        await self.start()
        conn = next((c for c in self.conns if endpoint in (None, c.endpoint)), None)
        if conn is None:
            raise InvalidRequest(f"endpoint {endpoint!r} is not one of this client's endpoints", field="endpoint")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.status_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                unsent = conn.sock.send(P.status_request_frames())
                while unsent is not None:  # not connected yet (IMMEDIATE): try again shortly
                    await asyncio.sleep(0.005)
                    self._check_open()
                    unsent = conn.sock.send(P.status_request_frames())
                return await fut
        except TimeoutError:
            if fut in conn.status_waiters:
                conn.status_waiters.remove(fut)
            raise Unavailable(f"broker {conn.endpoint} did not answer STATUS within {timeout}s") from None
        except asyncio.CancelledError:
            if self._closed and fut.cancelled():  # aclose() cancelled the waiter, not our caller
                raise ClientClosed("client closed while waiting for STATUS", field="client") from None
            raise
