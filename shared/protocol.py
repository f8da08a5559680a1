"""Frame layout and control commands for client <-> broker <-> worker (one home for the wire).

Every message starts with the protocol tag, then a one-byte command (zguide Majordomo style):

client  -> broker   [IBX1, REQUEST, payload]
broker  -> client   [IBX1, REPLY | ERROR, request_id, payload]
client  -> broker   [IBX1, STATUS]   ->   [IBX1, REPLY, b"", msgpack snapshot]   (ops and tests)

worker  -> broker   [IBX1, READY, info]                      info = msgpack {capacity, worker_id, pid}
worker  -> broker   [IBX1, HEARTBEAT, info]                  same info, plus stats and draining
worker  -> broker   [IBX1, REPLY | ERROR, client_id, request_id, payload]
worker  -> broker   [IBX1, DISCONNECT]                       stop sending me work (SIGTERM drain)
broker  -> worker   [IBX1, REQUEST, client_id, request_id, stamp, payload]
broker  -> worker   [IBX1, HEARTBEAT]

(ROUTER sockets add and strip the peer's routing id in front.) ``stamp`` is msgpack
{deadline_ns, queued_us, sent_ns, attempt}: the broker's queue wait and dispatch time travel with the
request so the reply can carry them. Payloads are the codec's msgpack models.

Liveness (zguide Paranoid Pirate): both sides send HEARTBEAT every interval and declare the peer dead
after ``liveness`` silent intervals. Socket disconnect events make a killed peer visible at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

TAG = b"IBX1"

REQUEST = b"\x01"
REPLY = b"\x02"
ERROR = b"\x03"
READY = b"\x04"
HEARTBEAT = b"\x05"
DISCONNECT = b"\x06"
STATUS = b"\x07"


# High-water marks: set before bind/connect. The broker's own queue (queue_max) is the real
# backlog bound; socket buffers only absorb bursts.
SNDHWM = 10_000
RCVHWM = 10_000

# Room for the routing frames around a payload (ids, stamp) under ZMQ_MAXMSGSIZE.
FRAME_OVERHEAD = 4096


def frontend_max_msgsize(max_request_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE for the broker's client side: twice the request limit.

    libzmq drops the whole connection on a message over this size, failing every request in flight
    on it. The client library refuses oversized requests before sending; a request between the
    limit and twice the limit (a raw or foreign client) still gets a typed INVALID_REQUEST naming the
    size, and only a message beyond that costs its own sender the connection.
    """
    return 2 * max_request_bytes + FRAME_OVERHEAD


def backend_max_msgsize(max_request_bytes: int, max_reply_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE between broker and workers: whichever way the larger payload travels.

    Workers never send a reply over ``max_reply_bytes`` (they answer a typed error instead) and
    the broker never forwards a request over ``max_request_bytes``, so this link is never cut by
    a peer's message size.
    """
    return max(max_request_bytes, max_reply_bytes) + FRAME_OVERHEAD


@dataclass(frozen=True, slots=True)
class Stamp:
    deadline_ns: int  # absolute, Unix epoch ns (as on the wire)
    queued_us: int  # time spent in the broker's queue
    sent_ns: int  # epoch ns when the broker dispatched
    attempt: int  # 1 for the first dispatch, 2+ after a worker died

    def pack(self) -> bytes:
        return msgpack.packb([self.deadline_ns, self.queued_us, self.sent_ns, self.attempt])  # type: ignore[no-any-return]

    @classmethod
    def unpack(cls, data: bytes) -> Stamp:
        raw: Any = msgpack.unpackb(data)
        if not (isinstance(raw, list) and len(raw) == 4 and all(type(x) is int for x in raw)):
            raise ValueError("malformed stamp frame")
        return cls(*raw)


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
