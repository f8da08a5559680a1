"""The protocol's fixed binary layouts: the request header, the dispatch stamp and the reply
feedback (docs/protocol.md "Frames").

Each is a small ``struct`` layout beside the msgpack payload, so the broker routes, authorizes and
times a request without unpacking it: its cost does not grow with the payload.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ...stores.keys import is_ident
from ..errors import ErrorCode
from ..models import PROTOCOL_VERSION, AssembleRequest, ErrorReply

# ------------------------------------------------------------------------------- the header


class Envelope(NamedTuple):
    """The fields the broker routes and authorizes on; the worker validates the whole request."""

    request_id: str
    org_id: str
    agent_id: str
    deadline_ns: int


def version_error(version: object, request_id: str | None) -> ErrorReply:
    """INVALID_REQUEST for a request in a protocol version this service does not speak."""
    return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST,
                      message=f"unsupported protocol version {version!r}; this service speaks {PROTOCOL_VERSION}",
                      field="v")


# version u8, deadline_ns u64, then the UTF-8 lengths of request_id (u16: 128 characters may take
# 512 bytes), org_id and agent_id (u8 each), then the three strings.
_HEADER = struct.Struct("<BQHBB")


def pack_header(env: Envelope) -> bytes:
    """The header frame for a request; ``ValueError`` when a field cannot be carried (the wire
    model refuses those values first, so the client library never meets it)."""
    rid, org, agent = (x.encode("utf-8") for x in (env.request_id, env.org_id, env.agent_id))
    if len(rid) > 65535 or len(org) > 255 or len(agent) > 255 or not 0 < env.deadline_ns < 1 << 64:
        raise ValueError("request header field out of range")
    return _HEADER.pack(PROTOCOL_VERSION, env.deadline_ns, len(rid), len(org), len(agent)) + rid + org + agent


def _header_error(message: str) -> ErrorReply:
    return ErrorReply(code=ErrorCode.INVALID_REQUEST, field="<header>", message=message)


def parse_header(data: bytes) -> Envelope | ErrorReply:
    """The header frame, checked exactly as the wire model checks the same fields of a payload
    (the worker then verifies the payload agrees, see ``header_mismatch``)."""
    if len(data) < _HEADER.size:
        return _header_error(f"request header of {len(data)} bytes is shorter than {_HEADER.size}")
    version, deadline, n_rid, n_org, n_agent = _HEADER.unpack_from(data)
    if len(data) != _HEADER.size + n_rid + n_org + n_agent:
        return _header_error(f"request header is {len(data)} bytes, its lengths say "
                             f"{_HEADER.size + n_rid + n_org + n_agent}")
    o = _HEADER.size
    a, b = o + n_rid, o + n_rid + n_org
    try:
        rid, org, agent = data[o:a].decode("utf-8"), data[a:b].decode("utf-8"), data[b:].decode("utf-8")
    except UnicodeDecodeError:
        return _header_error("request header is not UTF-8")
    request_id = rid if 1 <= len(rid) <= 128 else None

    def bad(field: str, why: str) -> ErrorReply:
        return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST, message=f"{field}: {why}",
                          field=field)

    if version != PROTOCOL_VERSION:
        return version_error(version, request_id)
    if request_id is None:
        return bad("request_id", "a string of 1 to 128 characters is required")
    if not is_ident(org):
        return bad("org_id", "1 to 64 of A-Z a-z 0-9 _ . - is required")
    if not is_ident(agent):
        return bad("agent_id", "1 to 64 of A-Z a-z 0-9 _ . - is required")
    if deadline <= 0:
        return bad("deadline_ns", "a positive integer (Unix epoch nanoseconds) is required")
    return Envelope(request_id, org, agent, deadline)


def header_mismatch(env: Envelope, req: AssembleRequest) -> ErrorReply | None:
    """INVALID_REQUEST naming the first field where the payload disagrees with the header it came
    with: the broker routed and authorized on the header, so the two may never name different
    tenants (or requests, or deadlines)."""
    for field in ("request_id", "org_id", "agent_id", "deadline_ns"):
        if getattr(env, field) != getattr(req, field):
            return ErrorReply(request_id=env.request_id, code=ErrorCode.INVALID_REQUEST, field=field,
                              message=f"{field}: the payload says {getattr(req, field)!r:.80}, its header says "
                                      f"{getattr(env, field)!r:.80}; they must agree")
    return None


# -------------------------------------------------------------------------------- the stamp

_STAMP = struct.Struct("<QQQI")


class Stamp(NamedTuple):
    """What travels with a dispatched request, in a fixed 28-byte layout (a tuple and a struct:
    the broker builds one per dispatch, so it costs ~0.3 µs where a frozen dataclass packed with
    msgpack cost ~2 µs)."""

    deadline_ns: int  # absolute, Unix epoch ns (as on the wire)
    queued_us: int  # time spent in the broker's queue
    sent_ns: int  # epoch ns when the broker dispatched
    attempt: int  # 1 for the first dispatch, 2+ after a worker died

    def pack(self) -> bytes:
        return _STAMP.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> Stamp:
        """``ValueError`` for anything but the 28-byte layout."""
        if len(data) != _STAMP.size:
            raise ValueError(f"malformed stamp frame: {len(data)} bytes, expected {_STAMP.size}")
        return cls._make(_STAMP.unpack(data))


# ----------------------------------------------------------------------------- the feedback

_FEEDBACK = struct.Struct("<BI")
OVERLOADED_FLAG = 1
GATE_FULL_FLAG = 2
MEMORY_FLAG = 4
REFUSED_FLAG = 8


class Feedback(NamedTuple):
    """The optional last frame of a worker's reply, for the broker's adaptive limit
    (``broker.admission``): a retrieval branch timed out or was skipped (the downstream could not
    keep up), the request's wait for the worker's event loop in µs (the worker's CPU could not
    keep up), whether the worker's memory gate (``worker.memgate``) was full as the reply left,
    so the broker refuses what the gate would (``broker.broker``), whether the assembly asked
    the memory service to embed its question (called it, or would have but for its gate): what the
    broker's dispatch rate paces (``broker.admission.MemoryCost``), and whether a memory call was
    refused for lack of capacity (``worker.memgate.memory_refused``): what that rate learns from.
    Layout: flags u8, loop lag µs u32; a broker that does not know a flag ignores it."""

    overloaded: bool
    loop_lag_us: int
    gate_full: bool = False
    memory: bool = False
    refused: bool = False

    def pack(self) -> bytes:
        flags = ((OVERLOADED_FLAG if self.overloaded else 0) | (GATE_FULL_FLAG if self.gate_full else 0)
                 | (MEMORY_FLAG if self.memory else 0) | (REFUSED_FLAG if self.refused else 0))
        return _FEEDBACK.pack(flags, min(max(0, self.loop_lag_us), 2**32 - 1))

    @classmethod
    def unpack(cls, data: bytes) -> Feedback:
        if len(data) != _FEEDBACK.size:
            raise ValueError(f"feedback frame of {len(data)} bytes, expected {_FEEDBACK.size}")
        flags, lag = _FEEDBACK.unpack(data)
        return cls(bool(flags & OVERLOADED_FLAG), lag, bool(flags & GATE_FULL_FLAG), bool(flags & MEMORY_FLAG),
                   bool(flags & REFUSED_FLAG))
