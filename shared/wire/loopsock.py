"""ZeroMQ sockets driven by the asyncio event loop without a Future per message.

pyzmq's ``zmq.asyncio`` sockets build a Future for every send and receive and convert socket
options through Python enums on the way; on the 2-core dev machine that costs ~220 µs of CPU per
request in a worker that does nothing else (``python -m bench.hops``). Here a plain
socket's edge-triggered FD is registered with ``loop.add_reader``: when it fires, ``_drain`` reads
every waiting message and hands each to a callback, and sends are non-blocking calls whose
failure is returned as a value (STYLE: non-blocking sends with the failure counted).

No receive is ever awaited, so none can be cancelled halfway and lose a message.

``send_frames``/``recv_frames`` are the frame loops of ``send_multipart``/``recv_multipart`` with
the flags as plain ints and ``Frame.more`` instead of a ``getsockopt(RCVMORE)`` per frame: about
half the cost per message (measured: 12 µs against 28 µs for a 6-frame message over inproc).
The synchronous broker uses them too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

log = logging.getLogger(__name__)

# The compiled socket's own send/recv, called directly: ``zmq.Socket.send`` is a Python wrapper
# (routing_id/group handling) that costs ~180 ns a frame on top (measured here: 380 vs 200 ns).
_send = _BackendSocket.send
_recv = _BackendSocket.recv
_get = _BackendSocket.get

NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | NOBLOCK
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
BURST = 256  # messages handled per wake-up before yielding to the loop


def send_frames(sock: zmq.Socket[Any], frames: Sequence[bytes | zmq.Frame]) -> None:
    """Send one multipart message without blocking; raises ``zmq.ZMQError`` (EAGAIN, EHOSTUNREACH).

    ZeroMQ queues a multipart message atomically: if the first frame is accepted, so are the rest.
    """
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, _MORE if i < last else NOBLOCK)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a whole message is waiting. Cheaper than letting ``recv`` fail: building the
    ``zmq.Again`` exception costs ~8 µs here, the EVENTS query ~2 µs."""
    return bool(int(_get(sock, _EVENTS)) & _POLLIN)


def recv_frames(sock: zmq.Socket[Any]) -> list[bytes]:
    """Receive one whole multipart message without blocking; raises ``zmq.Again`` when none waits."""
    return recv_message(sock)[0]


LARGE_FRAME = 32 * 1024  # from this size a frame the broker only forwards is not copied


def recv_forwarding(sock: zmq.Socket[Any],
                    payload_at: Callable[[list[Any]], int | None]) -> tuple[list[Any], zmq.Frame]:
    """``recv_message`` for a broker: the frame at ``payload_at(frames)`` stays a ``zmq.Frame`` when it
    is large, so it is forwarded without being copied twice (libzmq shares a large message's buffer
    between sends; measured in ``bench.hops --pad-kb 256``). Every other frame is bytes, whatever
    its size. ``payload_at`` sees the frames with large ones still as ``zmq.Frame`` (compare small ones)."""
    frame = _recv(sock, NOBLOCK, False)
    large = len(frame) >= LARGE_FRAME
    parts: list[Any] = [frame if large else frame.bytes]
    while frame.more:
        frame = _recv(sock, NOBLOCK, False)
        if len(frame) >= LARGE_FRAME:
            large = True
            parts.append(frame)
        else:
            parts.append(frame.bytes)
    if large:  # rare: only a large frame at the payload's place stays a Frame
        keep = payload_at(parts)
        for i, part in enumerate(parts):
            if i != keep and not isinstance(part, bytes):
                parts[i] = part.bytes
    return parts, frame


def recv_message(sock: zmq.Socket[Any]) -> tuple[list[bytes], zmq.Frame]:
    """``recv_frames`` plus the last frame object, whose metadata (``User-Id``) names the peer's
    authenticated key."""
    frame = _recv(sock, NOBLOCK, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, NOBLOCK, False)
        parts.append(frame.bytes)
    return parts, frame


class LoopSocket:
    """One ZeroMQ socket served by the running event loop.

    ``on_frames(frames)`` runs on the loop for every message, in arrival order. It should be quick
    (start a task for real work); an exception in it is logged and the next message still runs.
    Owns the socket: ``close()`` unregisters it and closes it with linger 0.
    """

    def __init__(self, sock: zmq.Socket[Any], on_frames: Callable[[list[bytes]], None], *,
                 name: str = "socket") -> None:
        self.sock = sock
        self.on_frames = on_frames
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._scheduled = False
        self.closed = False
        self.loop.add_reader(self.fd, self._drain)
        self._kick()  # the FD is edge-triggered: messages that arrived before now raise no edge

    def send(self, frames: Sequence[bytes]) -> zmq.ZMQError | None:
        """Non-blocking send; returns the error (EAGAIN: pipe full, EHOSTUNREACH: peer gone)."""
        if self.closed:
            return zmq.ZMQError(zmq.ENOTSOCK, f"{self.name} is closed")
        try:
            send_frames(self.sock, frames)
            return None
        except zmq.ZMQError as exc:
            return exc
        finally:
            # Any socket operation can consume the FD's edge for messages already waiting: look
            # again on the next loop turn rather than wait for an edge that will not come.
            self._kick()

    def drain(self) -> None:
        """Handle the messages waiting now, at once (not on the loop's next turn): a caller about to
        decide on what they would say (the client's monitor events) reads them first."""
        self._drain()

    def _kick(self) -> None:
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        if self.closed:
            self._scheduled = False
            return
        # While this loop runs, a send from ``on_frames`` needs no kick: the loop looks again after
        # every message (a synchronous reply then costs no extra loop turn and no extra EVENTS query).
        self._scheduled = True
        try:
            for _ in range(BURST):
                try:
                    if not readable(self.sock):
                        return
                    frames = recv_frames(self.sock)
                except zmq.ZMQError as exc:  # the socket is being torn down (context terminated)
                    log.debug("%s: receive failed: %s", self.name, exc)
                    return
                try:
                    self.on_frames(frames)
                except Exception:
                    log.exception("%s: message handler failed", self.name)
        finally:
            self._scheduled = False
        self._kick()  # more may be waiting: carry on next turn, after other callbacks ran

    def close(self, linger_ms: int = 0) -> None:
        """Unregister and close; ``linger_ms`` > 0 lets queued outbound messages go first."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        self.sock.close(linger=linger_ms)
