"""The frame protocol (docs/architecture.md "Processes and data flow"): every frame kind round-trips through its
builder and parser, a malformed frame of each kind is refused with ``FrameError``, and STATUS has
its own reply command, so a REPLY with an empty request id is an ordinary (unknown) reply.

Here: the checks through running servers; the pure parts are in
tests/unit/test_protocol.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from ibex_context.broker.broker import Broker
from ibex_context.client.client import AsyncClient
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.models import ErrorReply

# ------------------------------------------------------------------------- over real sockets


@pytest.fixture
def broker() -> Iterator[Broker]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    b = Broker(settings=Settings(), frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", ctx=ctx)
    thread = threading.Thread(target=b.serve_forever, daemon=True)
    thread.start()
    yield b
    b.stop()
    thread.join(timeout=5)
    ctx.term()


def test_broker_answers_status_with_its_own_command(broker: Broker) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with ctx.socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(broker.frontend_endpoint)
            s.send_multipart(P.status_request_frames())
            assert s.poll(5000), "broker did not answer STATUS"
            frames = s.recv_multipart()
            s.send_multipart([P.TAG, P.STATUS, b"extra"])  # malformed: a typed error, under no id
            assert s.poll(5000), "broker did not refuse a malformed STATUS"
            refusal = s.recv_multipart()
    finally:
        ctx.term()
    assert frames[:2] == [P.TAG, P.STATUS] and len(frames) == 3
    reply = P.parse_reply(frames)
    assert isinstance(reply, P.StatusReply)
    assert reply.snapshot["queue_depth"] == 0 and reply.snapshot["workers"] == {}
    assert refusal[:3] == [P.TAG, P.ERROR, b""]


async def test_client_drops_an_empty_id_reply_and_reads_status_from_status() -> None:
    """A stub broker (a real ROUTER) answers STATUS with an empty-id REPLY first: the client treats it
    as a late reply to nobody, and the status call returns the snapshot of the STATUS frame."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    done = threading.Event()

    def stub() -> None:
        while not done.is_set():
            if router.poll(50):
                ident, *frames = router.recv_multipart()
                assert P.parse_client_message(frames) == P.StatusRequest()
                router.send_multipart([ident, P.TAG, P.REPLY, b"", encode(ErrorReply(code="INTERNAL", message="?"))])
                router.send_multipart([ident, *P.status_reply_frames({"pid": 7, "stats": {}})])

    thread = threading.Thread(target=stub, daemon=True)
    thread.start()
    try:
        async with AsyncClient(endpoint, settings=Settings(), ctx=ctx) as client:
            await client.wait_connected(5.0)
            snapshot = await client.status(timeout=5.0)
            assert snapshot == {"pid": 7, "stats": {}}
            # Frames of one connection are handled in order: the REPLY before the STATUS answer.
            assert client.stats["late_replies_dropped"] == 1
    finally:
        done.set()
        thread.join(timeout=5)
        router.close(linger=0)
        ctx.term()
