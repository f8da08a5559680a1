"""One DEALER connection from the client library to one broker frontend.

Sockets are served by loop callbacks (``shared.wire.loopsock``), not awaited reads: a reply costs no
Future and no task switch on its way to the caller's future. ``IMMEDIATE`` queues only to live
connections, so a request to a broker that is down fails over at once (README "The client library").

Replies are matched to their callers by a correlation id the connection makes for each attempt,
never by the caller's ``request_id``: that is a label two callers may share (a LiteLLM call id comes
from the caller's own ``x-litellm-call-id`` header), and a reply matched by it could reach the
wrong caller, with the other caller's conversation in it (``shared.wire.protocol``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..shared.wire import protocol as P
from ..shared.wire.errors import (
    ERROR_BY_CODE,
    DeadlineExceeded,
    IbexError,
    Internal,
    Unauthenticated,
    Unavailable,
)
from ..shared.wire.loopsock import LoopSocket
from ..shared.wire.models import AssembleResponse, ErrorReply

# How long a new client may take to connect before "not connected" means the broker cannot be
# reached: a call whose deadline ends sooner, before any connection is ready, had too short a
# deadline (DeadlineExceeded), not a broker fault (a TCP or CURVE handshake takes a few ms).
CONNECT_GRACE_S = 0.25
MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_CONNECT_RETRIED)


@dataclass
class Conn:
    endpoint: str
    sock: LoopSocket = field(init=False)
    monitor: LoopSocket = field(init=False)
    connected: bool = False
    auth_failed: bool = False
    # a connection attempt failed (refused, unreachable) since the last handshake: the broker is
    # not there, rather than not yet connected
    refused: bool = False
    # by correlation id (one per attempt), never by request_id
    waiting: dict[str, asyncio.Future[AssembleResponse | ErrorReply | None]] = field(default_factory=dict)
    status_waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)
    # a random prefix and a counter: unique on this connection, and no caller can choose or predict one
    _prefix: str = field(default_factory=lambda: secrets.token_hex(8))
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def send(self, frames: list[bytes],
             fut: asyncio.Future[AssembleResponse | ErrorReply | None]) -> tuple[str, zmq.ZMQError | None]:
        """Send one attempt of a request whose reply ``fut`` waits for: (the id the reply is matched
        by, the send's error). ``frames`` are ``request_frames``; they go out as CORRELATED under an
        id new for every attempt (hex: never a usage report's ``usage-`` id), so two calls that share
        a ``request_id`` never share a reply."""
        key = f"{self._prefix}{next(self._seq):x}"
        self.waiting[key] = fut
        exc = self.sock.send(P.correlated_frames(frames, key.encode()))
        if exc is not None:
            del self.waiting[key]
        return key, exc

    def fail_all(self, exc: IbexError) -> None:
        """Answer every request waiting on this connection with ``exc`` (as an error reply)."""
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():  # the caller's own request_id goes on the error it raises (client.to_exc)
                fut.set_result(ErrorReply(code=exc.code, message=exc.message))

    def close(self) -> None:
        self.sock.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


def open_conn(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
              configure: Callable[[zmq.Socket[bytes]], None] | None,
              on_reply: Callable[[Conn, list[bytes]], None],
              on_event: Callable[[Conn, list[bytes]], None]) -> Conn:
    """A connecting DEALER and its monitor, each served by a loop callback."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to live connections: fail over fast
    sock.setsockopt(zmq.SNDHWM, P.SNDHWM)
    sock.setsockopt(zmq.RCVHWM, P.RCVHWM)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if configure is not None:
        configure(sock)
    mon = sock.get_monitor_socket(MONITOR_EVENTS)
    sock.connect(endpoint)
    conn = Conn(endpoint)
    conn.sock = LoopSocket(sock, functools.partial(on_reply, conn), name=f"broker {endpoint}")
    conn.monitor = LoopSocket(mon, functools.partial(on_event, conn), name=f"monitor {endpoint}")
    return conn


def time_out(fut: asyncio.Future[Any]) -> None:
    """Timer callback: a request's deadline passed with no reply (``None`` means "timed out")."""
    if not fut.done():
        fut.set_result(None)


def too_short(conns: list[Conn], never_tried: bool, timeout: float, age_s: float,
              request_id: str) -> DeadlineExceeded | None:
    """The error for a call whose deadline ended before its request could be sent, when the
    deadline (not a broker) is the cause: it passed before the first try, or while a client
    ``age_s`` old was still connecting (``CONNECT_GRACE_S``) and no connection attempt had failed
    (a broker that refuses connections is UNAVAILABLE)."""
    ms = f"{timeout * 1000:g} ms"
    if never_tried:
        return DeadlineExceeded(f"the {ms} deadline was too short to send the request (it passed before "
                                "the first try): allow more time", request_id=request_id)
    for c in conns:  # a refused connect may be waiting unread in a monitor's queue
        c.monitor.drain()
    # "connected" is not enough: the socket takes its new pipe on its next operation after the
    # handshake, so a send right after one may still find none
    if age_s < CONNECT_GRACE_S and not any(c.refused or c.auth_failed for c in conns):
        return DeadlineExceeded(f"the {ms} deadline was too short to send the request: the client was "
                                "still connecting to the broker (allow more time, or await "
                                "wait_connected() first)", request_id=request_id)
    return None


def pick(conns: list[Conn], start: int, tried: set[int]) -> Conn | None:
    """The next connection to try, round-robin from ``start``: connected ones first, none twice."""
    n = len(conns)
    order = [(start + i) % n for i in range(n)]
    for i in order:
        if i not in tried and conns[i].connected:
            tried.add(i)
            return conns[i]
    for i in order:
        if i not in tried:
            tried.add(i)
            return conns[i]
    return None


def failure(conns: list[Conn], last: ErrorReply | None, request_id: str) -> IbexError:
    """The error a call ends with once no broker can (or will) answer it."""
    if conns and all(c.auth_failed for c in conns):
        return Unauthenticated("every broker refused this client's key (CURVE handshake failed)",
                               request_id=request_id)
    if last is None:
        return Unavailable("no broker endpoint could take the request", request_id=request_id)
    cls = ERROR_BY_CODE.get(last.code, Internal)
    return cls(last.message, field=last.field, request_id=request_id)
