"""What the broker's parts share: the records of a request and a worker, the sends on its two
sockets (``Wire``), and the checks every caller's message passes first (``checked``).

The parts: ``broker.broker.Broker`` (frontend, the request table, dispatch, the loop) holds a
``broker.workers.WorkerTable`` (the live workers, their credit and liveness) and a
``broker.usage.UsageIntake`` (usage reports and summaries). Every request ends in exactly one
reply, always sent through ``Wire.reply_error`` or a forwarded worker reply (docs/architecture.md
"Processes and data flow").
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ..shared.wire import protocol as P
from ..shared.wire.codec import encode_error
from ..shared.wire.errors import DeadlineExceeded, IbexError
from ..shared.wire.loopsock import send_frames
from ..shared.wire.models import ErrorReply
from ..shared.wire.protocol import Envelope
from .admission import Limiter

log = logging.getLogger(__name__)

# (client routing id, correlation id): the caller's request_id is a label two calls may share, so
# it keys nothing (shared.wire.protocol); a request sent without a correlation id is keyed by its request_id.
Key = tuple[bytes, bytes]
MIN_RETRY_NS = 2_000_000  # re-dispatch only with at least 2 ms left
BURST = 256  # frontend messages drained per poll round

# Authorizer hook: given the frontend frame's auth metadata and the request's envelope, raise
# Forbidden/Unauthenticated or return. Wired by the CURVE/ZAP layer; None means no caller auth
# (loopback only).
Authorizer = Callable[[zmq.Frame, Envelope], None]


@dataclass(slots=True)
class Pending:
    key: Key
    request_id: str  # the caller's label: logs and error payloads name it
    org: str  # the org of its header: its queue in the broker's fair queue
    header: bytes
    payload: bytes
    deadline_epoch_ns: int
    deadline_ns: int  # local monotonic
    enqueued_ns: int
    attempt: int = 1
    worker: bytes | None = None
    answered: bool = False
    dispatched_ns: int = 0  # local monotonic, for the service time admission control learns from


@dataclass(slots=True)
class WorkerState:
    ident: bytes
    worker_id: str
    capacity: int
    expiry_ns: int
    inflight: set[Key] = field(default_factory=set)
    draining: bool = False
    stats: dict[str, int] = field(default_factory=dict)
    limiter: Limiter | None = None  # None: fixed credit (IBEX_ADAPTIVE_LIMIT=false)
    picked: int = 0  # when it was last dispatched to (a sequence number): ties go to the least recent
    gate_full: bool = False  # its memory gate had no free slot as its last reply left (protocol.Feedback)

    @property
    def slots(self) -> int:
        """Requests it may hold now: its adaptive limit, never more than its credit."""
        return self.capacity if self.limiter is None else self.limiter.slots

    @property
    def free(self) -> int:
        return 0 if self.draining else self.slots - len(self.inflight)


class Wire:
    """The broker's two sockets as every part of it sends on them: a failed send is counted and
    reported, never raised (a vanished client or worker must not stop the loop)."""

    def __init__(self, front: zmq.Socket[bytes], back: zmq.Socket[bytes], stats: collections.Counter[str]) -> None:
        self.front, self.back, self.stats = front, back, stats

    def reply_error(self, client: bytes, correlation_id: bytes, err: IbexError | ErrorReply,
                    request_id: str | None = None) -> None:
        """ERROR under the request's correlation id; the error itself names the caller's request_id."""
        self.send_front([client, *P.reply_frames(P.ERROR, correlation_id, encode_error(err, request_id))])

    def send_front(self, frames: list[bytes]) -> bool:
        try:
            send_frames(self.front, frames)
            return True
        except zmq.ZMQError as exc:  # client vanished (EHOSTUNREACH) or its pipe is full (EAGAIN)
            self.stats["client_send_failed"] += 1
            log.debug("frontend send failed: %s", exc)
            return False

    def send_back(self, frames: list[bytes]) -> bool:
        try:
            send_frames(self.back, frames)
            return True
        except zmq.ZMQError:
            self.stats["worker_send_failed"] += 1
            return False


def checked(req: Envelope, last: zmq.Frame, authorizer: Authorizer | None) -> tuple[str, IbexError] | None:
    """(counter, error) when a request or report is past its deadline or its caller may not act for
    its org and agent, else None: the checks every message of a caller passes before anything else."""
    remaining = req.deadline_ns - time.time_ns()
    if remaining <= 0:
        return "expired_at_receipt", DeadlineExceeded(
            f"deadline passed {-remaining / 1e6:.2f} ms before the broker received the request")
    if authorizer is not None:
        try:
            authorizer(last, req)
        except IbexError as exc:
            return f"rejected_{exc.code.value.lower()}", exc
    return None
