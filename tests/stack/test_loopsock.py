"""LoopSocket over real TCP sockets: nothing lost to the edge-triggered FD, order kept, errors as values."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from ibex_context.shared.wire import loopsock
from ibex_context.shared.wire.loopsock import LoopSocket, recv_frames, send_frames

# The client library runs on its caller's loop: every async test here runs on asyncio and uvloop.
pytestmark = pytest.mark.both_loops


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A ROUTER (ROUTER_MANDATORY) bound on a random port and a DEALER connected to it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    dealer.setsockopt(zmq.IDENTITY, b"d1")
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()


def _settle(router: zmq.Socket[bytes]) -> None:
    """Wait until the DEALER's connection is routable (its first message has arrived)."""
    assert router.poll(5000), "the dealer never connected"
    assert recv_frames(router) == [b"d1", b"hello"]


def test_frame_loops_round_trip_and_report_again(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, dealer = pair
    with pytest.raises(zmq.Again):
        recv_frames(router)
    send_frames(dealer, [b"hello"])
    _settle(router)
    msg = [b"d1", b"", b"a" * 5000, b"x"]
    send_frames(router, msg)
    assert dealer.poll(5000)
    assert recv_frames(dealer) == msg[1:]
    with pytest.raises(zmq.ZMQError) as exc:  # ROUTER_MANDATORY: an unknown peer is an error, not a drop
        send_frames(router, [b"nobody", b"x"])
    assert exc.value.errno == zmq.EHOSTUNREACH


def test_a_forwarded_payload_is_not_copied_and_nothing_else_stays_a_frame(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    """recv_forwarding (the broker's receive): only the payload position, and only when large,
    stays a zmq.Frame; it is sent on intact; a large frame anywhere else is bytes."""
    router, dealer = pair
    send_frames(dealer, [b"hello"])
    _settle(router)
    big, other = b"p" * (loopsock.LARGE_FRAME + 1), b"h" * (loopsock.LARGE_FRAME + 7)

    def at_payload(frames: list[object]) -> int:  # [identity, a, header, payload]
        return 3

    for payload in (big, b"small"):
        send_frames(dealer, [b"a", other, payload])
        assert router.poll(5000)
        parts, _ = loopsock.recv_forwarding(router, at_payload)
        assert parts[:3] == [b"d1", b"a", other] and isinstance(parts[2], bytes)
        assert isinstance(parts[3], zmq.Frame) == (payload is big) and bytes(parts[3]) == payload
        send_frames(router, [b"d1", *parts[1:]])  # forwarded as received
        assert dealer.poll(5000)
        assert recv_frames(dealer) == [b"a", other, payload]


async def test_messages_waiting_before_registration_and_bursts_arrive_in_order(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, dealer = pair
    send_frames(dealer, [b"hello"])
    _settle(router)
    n = loopsock.BURST * 3 + 7  # more than one drain round: the rest must not wait for a new edge
    for i in range(n // 2):  # already queued when the LoopSocket starts: no edge will announce them
        send_frames(router, [b"d1", str(i).encode()])
    await asyncio.sleep(0.05)
    got: list[int] = []
    done = asyncio.Event()

    def on_frames(frames: list[bytes]) -> None:
        got.append(int(frames[0]))
        if len(got) == n:
            done.set()

    ls = LoopSocket(dealer, on_frames, name="test")
    try:
        for i in range(n // 2, n):
            send_frames(router, [b"d1", str(i).encode()])
        await asyncio.wait_for(done.wait(), 5)
        assert got == list(range(n))
    finally:
        ls.close()
    assert ls.send([b"late"]) is not None  # a closed LoopSocket reports, never raises


async def test_a_failing_handler_does_not_stall_delivery(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, dealer = pair
    got: list[bytes] = []
    done = asyncio.Event()

    def on_frames(frames: list[bytes]) -> None:
        if frames[0] == b"boom":
            raise RuntimeError("handler bug")
        got.append(frames[0])
        if len(got) == 2:
            done.set()

    ls = LoopSocket(dealer, on_frames, name="test")
    try:
        assert ls.send([b"hello"]) is None
        await asyncio.sleep(0)
        assert router.poll(5000)
        _settle(router)
        for m in (b"a", b"boom", b"b"):
            send_frames(router, [b"d1", m])
        await asyncio.wait_for(done.wait(), 5)
        assert got == [b"a", b"b"]
    finally:
        ls.close()


async def test_send_failure_is_a_value(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, _dealer = pair
    ls = LoopSocket(router, lambda frames: None, name="router")
    try:
        err = ls.send([b"nobody", b"x"])
        assert isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH
    finally:
        ls.close()
