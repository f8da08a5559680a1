"""What the broker remembers between messages, and the sends every part of it shares.

``BrokerBase`` holds the request table (pending, queue, deadline timers), the worker table and
the counters; ``broker.workers`` (backend side) and ``broker.broker`` (frontend, dispatch, loop)
build on it. Every request ends in exactly one reply, always sent through ``_reply_error`` or a
forwarded worker reply (docs/architecture.md "Processes and data flow").
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ibex_context.broker.admission import Limiter, StandingQueue
from ibex_context.broker.fairqueue import FairQueue
from ibex_context.broker.org_counts import TopCounts, org_snapshot
from ibex_context.shared.config.settings import BrokerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode_error
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.loopsock import send_frames
from ibex_context.shared.wire.models import ErrorReply
from ibex_context.shared.wire.protocol import Envelope

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


class BrokerBase:
    """Tables, counters and sends; no socket is made here (``Broker.__init__`` makes them)."""

    settings: BrokerSettings
    front: zmq.Socket[bytes]
    back: zmq.Socket[bytes]
    hb_ns: int
    liveness: int
    queue: FairQueue[Key]  # per-org FIFOs, dispatched in weighted fair order
    standing: dict[str, StandingQueue]  # per org with requests queued: CoDel's standing-queue test
    org_shed: TopCounts  # requests refused OVERLOADED on receipt or pushed out, per org
    pending: dict[Key, Pending]
    timers: list[tuple[int, int, Key]]  # (deadline_ns, attempt, key)
    workers: dict[bytes, WorkerState]
    stats: collections.Counter[str]

    def _answer_error(self, key: Key, exc: IbexError) -> None:
        p = self.pending.pop(key, None)
        self._reply_error(key[0], key[1], exc, p.request_id if p is not None else None)

    def _reply_error(self, client: bytes, correlation_id: bytes, err: IbexError | ErrorReply,
                     request_id: str | None = None) -> None:
        """ERROR under the request's correlation id; the error itself names the caller's request_id."""
        self._send_front([client, *P.reply_frames(P.ERROR, correlation_id, encode_error(err, request_id))])

    def _send_front(self, frames: list[bytes]) -> bool:
        try:
            send_frames(self.front, frames)
            return True
        except zmq.ZMQError as exc:  # client vanished (EHOSTUNREACH) or its pipe is full (EAGAIN)
            self.stats["client_send_failed"] += 1
            log.debug("frontend send failed: %s", exc)
            return False

    def _send_back(self, frames: list[bytes]) -> bool:
        try:
            send_frames(self.back, frames)
            return True
        except zmq.ZMQError:
            self.stats["worker_send_failed"] += 1
            return False

    def _left_queue(self, org: str) -> None:
        """A request of ``org`` left the queue (dispatched, expired or pushed out): once its org has
        none waiting, its standing-queue state goes (a standing queue never empties), so the table
        holds only orgs with requests queued."""
        if not self.queue.queued(org):
            self.standing.pop(org, None)

    def snapshot(self, *, orgs: bool = True) -> dict[str, object]:
        """Counters and gauges for STATUS requests, metrics and tests; per org only the busiest
        (``broker.org_counts``), so a caller naming many orgs cannot grow it. ``orgs=False`` leaves
        the per-org part out: it walks the pending requests, and the metrics thread reads the
        snapshot while the broker's thread changes them."""
        snap: dict[str, object] = {
            "pid": os.getpid(),
            "queue_depth": len(self.queue),
            "pending": len(self.pending),
            "workers": {w.worker_id: {"capacity": w.capacity, "limit": w.slots, "inflight": len(w.inflight),
                                      "draining": w.draining, "stats": w.stats}
                        for w in self.workers.values()},
            "stats": dict(self.stats),
        }
        if orgs:
            inflight = (p.org for p in self.pending.values() if p.worker is not None and not p.answered)
            snap |= org_snapshot(self.queue.queued_by_org(), inflight, self.org_shed)
        return snap
