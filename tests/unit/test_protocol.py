"""The frame protocol (docs/architecture.md "Processes and data flow"): every frame kind round-trips through its
builder and parser, a malformed frame of each kind is refused with ``FrameError``, and STATUS has
its own reply command, so a REPLY with an empty request id is an ordinary (unknown) reply.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_protocol.py.
"""

from __future__ import annotations

import msgpack
import pytest

from ibex_context.shared.wire import protocol as P

STAMP = P.Stamp(deadline_ns=123, queued_us=4, sent_ns=5, attempt=1)
INFO = P.Info(capacity=4, worker_id="w-1", pid=42, stats={"replied": 3}, draining=False)


# ---------------------------------------------------------------------------- round trips


def test_client_messages_round_trip() -> None:
    assert P.parse_client_message(P.request_frames(b"head", b"payload")) == P.ClientRequest(b"payload", b"head")
    with pytest.raises(P.FrameError):  # a request without a header frame is not a frame kind
        P.parse_client_message([P.TAG, P.REQUEST, b"payload"])
    with pytest.raises(P.FrameError):  # nor is the previous generation's tag
        P.parse_client_message([b"IBX1", P.REQUEST, b"head", b"payload"])
    assert P.parse_client_message(P.status_request_frames()) == P.StatusRequest()


def test_broker_replies_round_trip() -> None:
    assert P.parse_reply(P.reply_frames(P.REPLY, b"r-1", b"body")) == P.Reply(False, "r-1", b"body")
    assert P.parse_reply(P.reply_frames(P.ERROR, b"r-2", b"err")) == P.Reply(True, "r-2", b"err")
    snapshot = {"pid": 1, "queue_depth": 0, "workers": {}, "stats": {"accepted": 2}}
    assert P.parse_reply(P.status_reply_frames(snapshot)) == P.StatusReply(snapshot)


def test_worker_messages_round_trip() -> None:
    assert P.parse_worker_message(P.ready_frames(INFO)) == P.WorkerReady(INFO)
    assert P.parse_worker_message(P.heartbeat_frames(INFO)) == P.WorkerHeartbeat(INFO)
    assert P.parse_worker_message(P.heartbeat_frames()) == P.WorkerHeartbeat(None)
    assert P.parse_worker_message(P.worker_reply_frames(P.REPLY, b"c", b"r", b"x")) == P.WorkerReply(
        P.REPLY, b"c", b"r", b"x")
    assert P.parse_worker_message(P.worker_reply_frames(P.ERROR, b"c", b"r", b"x")).cmd == P.ERROR
    assert P.parse_worker_message(P.disconnect_frames()) == P.WorkerDisconnect()


def test_broker_to_worker_round_trip() -> None:
    assert P.parse_broker_message(P.dispatch_frames(b"c", b"r", STAMP, b"h", b"x")) == P.Dispatch(
        b"c", b"r", STAMP, b"h", b"x")
    assert P.parse_broker_message(P.heartbeat_frames()) == P.BrokerHeartbeat()


# ------------------------------------------------------------------------------ malformed


@pytest.mark.parametrize("frames", [
    [], [b"nope", P.REQUEST, b"x"], [P.TAG], [P.TAG, P.REQUEST], [P.TAG, P.REQUEST, b"x", b"y", b"z"],
    [P.TAG, P.STATUS, b"extra"], [P.TAG, P.REPLY, b"r", b"x"], [P.TAG, b"\x7f", b"x"],
])
def test_malformed_client_message_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(P.FrameError, match="expected frames"):
        P.parse_client_message(frames)


@pytest.mark.parametrize("frames", [
    [], [b"nope", P.REPLY, b"r", b"x"], [P.TAG, P.REPLY, b"r"], [P.TAG, P.ERROR, b"r", b"x", b"y"],
    [P.TAG, P.STATUS], [P.TAG, P.STATUS, b"\xc1"], [P.TAG, P.STATUS, msgpack.packb([1, 2])],
    [P.TAG, P.REQUEST, b"x"],
])
def test_malformed_broker_reply_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(P.FrameError):
        P.parse_reply(frames)


@pytest.mark.parametrize("frames", [
    [], [b"nope", P.READY, INFO.pack()], [P.TAG, P.READY], [P.TAG, P.READY, b"\xc1"],
    [P.TAG, P.READY, msgpack.packb({"capacity": 0, "worker_id": "w", "pid": 1})],
    [P.TAG, P.HEARTBEAT, msgpack.packb("not a map")], [P.TAG, P.REPLY, b"c", b"r"],
    [P.TAG, P.DISCONNECT, b"x"], [P.TAG, P.REQUEST, b"x"],
])
def test_malformed_worker_message_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(P.FrameError):
        P.parse_worker_message(frames)


@pytest.mark.parametrize("frames", [
    [], [b"nope", P.HEARTBEAT], [P.TAG, P.REQUEST, b"c", b"r", STAMP.pack()], [P.TAG, P.READY, b"x"],
    [P.TAG, P.REQUEST, b"c", b"r", STAMP.pack(), b"payload without its header"],
])
def test_malformed_broker_message_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(P.FrameError) as info:
        P.parse_broker_message(frames)
    assert type(info.value) is P.FrameError


@pytest.mark.parametrize("stamp", [b"\xc1", msgpack.packb([1, 2, 3, 4]), msgpack.packb([1, 2, 3]),
                                   msgpack.packb(["a", 1, 2, 3]), msgpack.packb([1, -2, 3, 4]), b"\x00" * 27,
                                   b"\x00" * 29])
def test_malformed_stamp_still_names_whom_to_answer(stamp: bytes) -> None:
    with pytest.raises(P.MalformedStamp) as info:
        P.parse_broker_message([P.TAG, P.REQUEST, b"client", b"r-9", stamp, b"h", b"x"])
    assert (info.value.client, info.value.request_id) == (b"client", b"r-9")


def test_stamp_is_28_bytes_and_nothing_else_reads_as_one() -> None:
    stamp = P.Stamp(deadline_ns=2**63, queued_us=12, sent_ns=2**62, attempt=2)
    assert len(stamp.pack()) == 28 and P.Stamp.unpack(stamp.pack()) == stamp
    with pytest.raises(ValueError, match="expected 28"):  # a msgpack array is not a stamp
        P.Stamp.unpack(msgpack.packb([2**63, 12, 2**62, 2]))


def test_reply_with_empty_request_id_is_an_ordinary_reply() -> None:
    assert P.parse_reply([P.TAG, P.REPLY, b"", b"x"]) == P.Reply(False, "", b"x")
