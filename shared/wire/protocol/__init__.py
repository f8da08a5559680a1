"""Frame layout and control commands for client <-> broker <-> worker (one home for the wire).

Every message starts with the protocol tag, then a one-byte command (zguide Majordomo style):

client  -> broker   [IBX2, CORRELATED, correlation_id, header, payload]   the client library's form
client  -> broker   [IBX2, REQUEST, header, payload]           correlated by its request_id
broker  -> client   [IBX2, REPLY | ERROR, correlation_id, payload]
client  -> broker   [IBX2, STATUS]   ->   [IBX2, STATUS, msgpack snapshot]   (ops and tests)
client  -> broker   [IBX2, USAGE | SUMMARY, payload]   a usage report, a summary to store; no reply unless refused

worker  -> broker   [IBX2, READY, info]                      info = msgpack {capacity, worker_id, pid}
worker  -> broker   [IBX2, HEARTBEAT, info]                  same info, plus stats and draining
worker  -> broker   [IBX2, REPLY | ERROR, client_id, correlation_id, payload(, feedback)]
worker  -> broker   [IBX2, DISCONNECT]                       stop sending me work (SIGTERM drain)
broker  -> worker   [IBX2, REQUEST, client_id, correlation_id, stamp, header, payload]
broker  -> worker   [IBX2, HEARTBEAT]
broker  -> worker   [IBX2, USAGE | SUMMARY, payload]   forwarded after the broker authorized it; no reply

Replies are matched by ``correlation_id``, never by the caller's ``request_id`` (a label the caller
picks: two calls may share it, and it still names the call in logs). The client library sends each
attempt as CORRELATED under an id of its own, which the broker keys in-flight requests by (with the
client's routing id) and the worker echoes; a REQUEST is correlated by its request_id, one per id.

``feedback`` (optional, ``Feedback``): what the broker's admission control learns from the worker
about this request (a retrieval branch timed out; how long it waited for the worker's loop).

(ROUTER sockets add and strip the peer's routing id in front.) ``stamp`` is (deadline_ns, queued_us,
sent_ns, attempt) as little-endian unsigned ints (``Stamp``): the broker's queue wait and dispatch
time travel with the request so the reply can carry them. Payloads are the codec's msgpack models.

``header`` (``layouts.pack_header``) carries what the broker routes and authorizes on
(version, request_id, org_id, agent_id, deadline_ns) in a small fixed layout, so the broker's cost
does not grow with the payload: it checks the header as strictly as the wire model checks those
fields, and forwards header and payload untouched. The worker refuses a payload that disagrees
with its header (``layouts.header_mismatch``). Header, stamp and feedback are fixed binary layouts
(``protocol.layouts``); every name the wire uses is importable from here.

Every frame kind has a builder (``*_frames``) and one parser per direction (``parse_*``); a
message that is none of the kinds raises ``FrameError`` naming what was wrong, so broker, worker,
client and ops never index frames themselves (docs/architecture.md "Processes and data flow").

Liveness (zguide Paranoid Pirate): both sides send HEARTBEAT every interval and declare the peer dead
after ``liveness`` silent intervals. Socket disconnect events make a killed peer visible at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from .layouts import OVERLOADED_FLAG as OVERLOADED_FLAG
from .layouts import Envelope as Envelope
from .layouts import Feedback as Feedback
from .layouts import Stamp as Stamp
from .layouts import header_mismatch as header_mismatch
from .layouts import pack_header as pack_header
from .layouts import parse_header as parse_header
from .layouts import version_error as version_error

TAG = b"IBX2"  # the protocol's generation: a peer speaking another tag is refused whole

REQUEST = b"\x01"
REPLY = b"\x02"
ERROR = b"\x03"
READY = b"\x04"
HEARTBEAT = b"\x05"
DISCONNECT = b"\x06"
STATUS = b"\x07"
USAGE = b"\x08"  # docs/assembly.md "Calibrated token counts": takes no credit, never queued behind requests
CORRELATED = b"\x09"  # a request under the client's own correlation id (module docstring)
SUMMARY = b"\x0a"  # README "Compaction summaries": a msgpack SummaryWrite, admitted like USAGE
MAX_CORRELATION_BYTES = 64

# A usage report is a few hundred bytes; anything much larger is refused by the broker.
MAX_USAGE_BYTES = 4096


# High-water marks: set before bind/connect. The broker's own queue (queue_max) is the real
# backlog bound; socket buffers only absorb bursts.
SNDHWM = 10_000
RCVHWM = 10_000

# Room for the routing frames around a payload (ids, stamp) under ZMQ_MAXMSGSIZE.
FRAME_OVERHEAD = 4096


def frontend_max_msgsize(max_request_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE for the broker's client side: twice the request limit. libzmq drops the whole
    connection on a message over this size, failing every request in flight on it. The client
    library refuses oversized requests before sending; a request between the limit and twice the
    limit (a raw or foreign client) still gets a typed INVALID_REQUEST naming the size, and only a
    message beyond that costs its own sender the connection."""
    return 2 * max_request_bytes + FRAME_OVERHEAD


def backend_max_msgsize(max_request_bytes: int, max_reply_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE between broker and workers: whichever way the larger payload travels. Workers
    never send a reply over ``max_reply_bytes`` (they answer a typed error instead) and the broker
    never forwards a request over ``max_request_bytes``, so this link is never cut by a peer's
    message size."""
    return max(max_request_bytes, max_reply_bytes) + FRAME_OVERHEAD


@dataclass(frozen=True, slots=True)
class Info:
    """What a worker announces in READY and every HEARTBEAT: its credit, name, pid, counters and
    whether it is draining. Parsed once, here, with every field checked."""

    capacity: int
    worker_id: str
    pid: int
    stats: dict[str, int] = field(default_factory=dict)
    draining: bool = False

    def pack(self) -> bytes:
        return msgpack.packb({"capacity": self.capacity, "worker_id": self.worker_id, "pid": self.pid,  # type: ignore[no-any-return]
                              "stats": self.stats, "draining": self.draining})

    @classmethod
    def unpack(cls, data: bytes) -> Info:
        """Raises ``ValueError`` on anything but a well-formed info map."""
        try:
            raw: Any = msgpack.unpackb(data)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"info is not msgpack: {type(exc).__name__}") from exc
        if not isinstance(raw, dict):
            raise ValueError("info must be a map")
        cap, wid, pid = raw.get("capacity"), raw.get("worker_id"), raw.get("pid")
        if type(cap) is not int or not 1 <= cap <= 100_000 or not isinstance(wid, str) or type(pid) is not int:
            raise ValueError("info needs capacity (1..100000), worker_id and pid")
        stats = raw.get("stats")
        counters = {str(k): v for k, v in stats.items() if type(v) is int} if isinstance(stats, dict) else {}
        return cls(cap, wid, pid, counters, raw.get("draining") is True)


# ------------------------------------------------------------------------------------ frames


class FrameError(ValueError):
    """A multipart message that is not one of the protocol's frame kinds (decode failures are
    values for payloads; a frame layout the peer should never send is refused with this)."""


class MalformedStamp(FrameError):
    """A broker REQUEST whose stamp frame is unreadable: the worker still knows whom to answer."""

    def __init__(self, message: str, client: bytes, request_id: bytes) -> None:
        super().__init__(message)
        self.client = client
        self.request_id = request_id


def _tagged(frames: list[bytes], what: str) -> bytes:
    """The command byte of a tagged message, after checking the tag."""
    if len(frames) < 2 or frames[0] != TAG:
        raise FrameError(f"{what}: expected [{TAG!r}, command, ...], got {len(frames)} frame(s)")
    return frames[1]


def _unpack_snapshot(data: bytes) -> dict[str, Any]:
    try:
        raw: Any = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"STATUS snapshot is not msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict):
        raise FrameError("STATUS snapshot must be a map")
    return raw


# client -> broker


class ClientRequest(NamedTuple):
    payload: bytes
    header: bytes
    correlation_id: bytes | None = None  # None: sent as REQUEST, correlated by its request_id


class StatusRequest(NamedTuple):
    pass


class UsageMessage(NamedTuple):
    """A usage report (client -> broker, and forwarded broker -> worker): a msgpack ``UsageReport``."""

    payload: bytes


class SummaryMessage(NamedTuple):
    payload: bytes  # a msgpack ``shared.wire.summary_write.SummaryWrite``, carried as USAGE is


def request_frames(header: bytes, payload: bytes) -> list[bytes]:
    return [TAG, REQUEST, header, payload]


def correlated_frames(frames: list[bytes], correlation_id: bytes) -> list[bytes]:
    """``request_frames`` sent as CORRELATED, under ``correlation_id``."""
    if len(frames) != 4 or frames[:2] != [TAG, REQUEST]:
        raise FrameError(f"expected request_frames [{TAG!r}, REQUEST, header, payload], got {len(frames)} frame(s)")
    return [TAG, CORRELATED, correlation_id, frames[2], frames[3]]


def status_request_frames() -> list[bytes]:
    return [TAG, STATUS]


def usage_frames(payload: bytes, cmd: bytes = USAGE) -> list[bytes]:
    """A usage report (or, ``cmd`` SUMMARY, a summary), client to broker and broker to one worker."""
    return [TAG, cmd, payload]


def parse_client_message(frames: list[bytes]) -> ClientRequest | StatusRequest | UsageMessage | SummaryMessage:
    """What a client sent the broker (routing id already stripped)."""
    if frames and frames[0] == TAG:
        if len(frames) == 5 and frames[1] == CORRELATED and 0 < len(frames[2]) <= MAX_CORRELATION_BYTES:
            return ClientRequest(frames[4], frames[3], frames[2])
        if len(frames) == 4 and frames[1] == REQUEST:
            return ClientRequest(frames[3], frames[2])
        if len(frames) == 3 and frames[1] in (USAGE, SUMMARY):
            return (UsageMessage if frames[1] == USAGE else SummaryMessage)(frames[2])
        if len(frames) == 2 and frames[1] == STATUS:
            return StatusRequest()
    raise FrameError(f"expected frames [{TAG!r}, REQUEST, header, payload] or [{TAG!r}, CORRELATED, an id of 1 to "
                     f"{MAX_CORRELATION_BYTES} bytes, header, payload], got {len(frames)} frame(s)")


# broker -> client


class Reply(NamedTuple):
    """A REPLY or ERROR for one request; an empty id is just an id no caller waits for."""

    is_error: bool
    correlation_id: str  # the request's correlation id (its request_id if it was sent as REQUEST)
    payload: bytes


class StatusReply(NamedTuple):
    snapshot: dict[str, Any]


def reply_frames(cmd: bytes, correlation_id: bytes, payload: bytes) -> list[bytes]:
    """``cmd`` is REPLY or ERROR."""
    return [TAG, cmd, correlation_id, payload]


def status_reply_frames(snapshot: dict[str, Any]) -> list[bytes]:
    return [TAG, STATUS, msgpack.packb(snapshot)]


def parse_reply(frames: list[bytes]) -> Reply | StatusReply:
    """What a broker sent a client."""
    cmd = _tagged(frames, "broker reply")
    if cmd in (REPLY, ERROR) and len(frames) == 4:
        return Reply(cmd == ERROR, frames[2].decode(errors="replace"), frames[3])
    if cmd == STATUS and len(frames) == 3:
        return StatusReply(_unpack_snapshot(frames[2]))
    raise FrameError(f"broker reply: unexpected command {cmd!r} with {len(frames)} frame(s)")


# worker -> broker


class WorkerReady(NamedTuple):
    info: Info


class WorkerHeartbeat(NamedTuple):
    info: Info | None  # None: a bare heartbeat (liveness only)


class WorkerReply(NamedTuple):
    cmd: bytes  # REPLY or ERROR, forwarded to the client as is
    client: bytes
    request_id: bytes  # the correlation id the request was dispatched with, echoed
    payload: bytes
    feedback: Feedback | None = None


class WorkerDisconnect(NamedTuple):
    pass


WorkerMessage = WorkerReady | WorkerHeartbeat | WorkerReply | WorkerDisconnect


def ready_frames(info: Info) -> list[bytes]:
    return [TAG, READY, info.pack()]


def heartbeat_frames(info: Info | None = None) -> list[bytes]:
    """A worker's heartbeat carries its info; the broker's is bare."""
    return [TAG, HEARTBEAT] if info is None else [TAG, HEARTBEAT, info.pack()]


def worker_reply_frames(cmd: bytes, client: bytes, request_id: bytes, payload: bytes,
                        feedback: Feedback | None = None) -> list[bytes]:
    frames = [TAG, cmd, client, request_id, payload]
    if feedback is not None:
        frames.append(feedback.pack())
    return frames


def disconnect_frames() -> list[bytes]:
    return [TAG, DISCONNECT]


def _info(data: bytes) -> Info:
    try:
        return Info.unpack(data)
    except ValueError as exc:
        raise FrameError(f"malformed worker info: {exc}") from exc


def parse_worker_message(frames: list[bytes]) -> WorkerMessage:
    """What a worker sent the broker (routing id already stripped)."""
    cmd = _tagged(frames, "worker message")
    n = len(frames)
    if cmd in (REPLY, ERROR) and n == 5:
        return WorkerReply(cmd, frames[2], frames[3], frames[4])
    if cmd in (REPLY, ERROR) and n == 6:
        try:
            feedback = Feedback.unpack(frames[5])
        except ValueError:  # the reply itself is still good: forward it, learn nothing from it
            feedback = None
        return WorkerReply(cmd, frames[2], frames[3], frames[4], feedback)
    if cmd == HEARTBEAT:  # only a three-frame heartbeat carries info; any other is liveness alone
        return WorkerHeartbeat(_info(frames[2]) if n == 3 else None)
    if cmd == READY and n == 3:
        return WorkerReady(_info(frames[2]))
    if cmd == DISCONNECT and n == 2:
        return WorkerDisconnect()
    raise FrameError(f"worker message: unexpected command {cmd!r} with {n} frame(s)")


# broker -> worker


class Dispatch(NamedTuple):
    client: bytes
    request_id: bytes  # the correlation id: the worker's reply carries it back untouched
    stamp: Stamp
    header: bytes  # as the client sent it
    payload: bytes  # untouched


class BrokerHeartbeat(NamedTuple):
    pass


class DrainAck(NamedTuple):
    """The broker's answer to a worker's DISCONNECT: nothing more will be dispatched on this link.
    ZeroMQ keeps a pipe's order, so every request dispatched before it arrives before it."""


def dispatch_frames(client: bytes, request_id: bytes, stamp: Stamp, header: bytes, payload: bytes) -> list[bytes]:
    return [TAG, REQUEST, client, request_id, stamp.pack(), header, payload]


def parse_broker_message(frames: list[bytes]) -> Dispatch | BrokerHeartbeat | DrainAck | UsageMessage | SummaryMessage:
    """What a broker sent a worker; an unreadable stamp raises ``MalformedStamp`` (answerable)."""
    cmd = _tagged(frames, "broker message")
    if cmd == HEARTBEAT:
        return BrokerHeartbeat()
    if cmd in (USAGE, SUMMARY) and len(frames) == 3:
        return (UsageMessage if cmd == USAGE else SummaryMessage)(frames[2])
    if cmd == DISCONNECT and len(frames) == 2:
        return DrainAck()
    if cmd != REQUEST or len(frames) != 7:
        raise FrameError(f"broker message: unexpected command {cmd!r} with {len(frames)} frame(s)")
    _, _, client, rid, stamp, header, payload = frames
    try:
        return Dispatch(client, rid, Stamp.unpack(stamp), header, payload)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedStamp("broker sent a malformed stamp", client, rid) from exc
