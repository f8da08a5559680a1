"""The load-balancing broker: ROUTER frontend for clients, ROUTER backend for workers.

Design (zguide load-balancing broker + Paranoid Pirate, with gRPC-style deadlines):

* The frontend is drained continuously into the broker's own bounded queue, so backlog never hides
  in socket buffers. The queue is one FIFO per org, dispatched in weighted fair order
  (``broker.fairqueue``, ``IBEX_ORG_WEIGHTS``): an org alone may use every slot, and an org with
  work is never behind another's backlog for more than its share. When the queue is full, an
  arrival of an org under its share of it pushes out the newest request of the org most over
  its share (answered OVERLOADED); any other arrival hears OVERLOADED at once.
* Credit-based dispatch under an adaptive limit: each worker announces its capacity (requests it
  can hold in flight; its retrieval is I/O-bound) and the broker holds it to an adaptive limit
  below that cap, cut when the worker's per-reply feedback says the downstream or its loop could
  not keep up (``broker.admission``). A request goes to the live worker with most free slots,
  ties to the one dispatched to least recently. With its org's queue standing, a request that
  could not be answered in full at its org's share of the slots is refused OVERLOADED on receipt:
  a longer deadline buys no org a place ahead of another. While every worker's memory gate is
  full (a flag in its replies' feedback), an org holding at least an equal share of the requests
  in flight is refused on receipt too, with no hop to a worker. ``IBEX_ADMISSION_LIFO``: an org
  whose queue stands is served newest first (docs/architecture.md "Admission control").
  ``IBEX_ADMISSION_HOLD``: a slot whose degraded reply came back before a service time had passed
  stays held for its org until then (``broker.admission.Holds``), so an org is dispatched no faster
  than the memory service behind the workers answers; a held slot is free for every other org.
  ``IBEX_ADMISSION_RATE``: requests whose assemblies embed a question at the memory service are
  dispatched no faster than a rate learned from the replies (``broker.admission.DispatchRate``),
  each org taking its share of it in fair order; a request its org's share of that rate cannot
  reach in time is refused OVERLOADED on receipt.
* The broker routes and authorizes on the request's header frame and never reads the payload; a
  large payload is forwarded as the frame it arrived in, uncopied (docs/architecture.md "Processes and data flow").
* Deadlines: the wire carries absolute Unix-epoch ns; they are converted once, on receipt, to local
  monotonic ns. Expired requests are dropped at receipt, in the queue and at dispatch, counted by
  reason, and the client is told DEADLINE_EXCEEDED. A request whose deadline passes while a worker
  holds it is answered DEADLINE_EXCEEDED by the broker; the worker's late reply only frees credit.
* Usage reports and summaries to store (``broker.usage``) take no credit and never enter the queue:
  they are held to token buckets per caller key, per org and in total, and shed while requests
  wait for a worker.
* Liveness: heartbeats both ways; a backend disconnect event triggers an immediate probe
  (ROUTER_MANDATORY makes a send to a vanished peer fail with EHOSTUNREACH). Requests in flight on a
  dead worker are re-dispatched if their deadline still allows (assembly is read-only), else
  answered UNAVAILABLE. Every request ends in exactly one reply.

Single-threaded and synchronous on purpose: the broker does no I/O but sockets, and one thread with
a poller has no locks and no scheduling surprises.
"""

from __future__ import annotations

import collections
import functools
import heapq
import logging
import os
import time
from collections.abc import Callable, Container

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..shared.config.settings import BrokerSettings
from ..shared.wire import protocol as P
from ..shared.wire.errors import (
    DeadlineExceeded,
    ErrorCode,
    IbexError,
    InvalidRequest,
    Overloaded,
    Unavailable,
)
from ..shared.wire.loopsock import readable, recv_forwarding
from ..shared.wire.models import ErrorReply
from ..shared.wire.protocol import Envelope, parse_header
from .admission import (
    STALE_FACTOR,
    DispatchRate,
    Holds,
    LightOrgs,
    MemoryCost,
    ServiceTime,
    StandingQueue,
    counts_in_service,
    expected_wait_ns,
    hold_until_ns,
    shed,
    takes_headroom,
    tokens_taken,
)
from .fairqueue import FairQueue
from .org_counts import TopCounts, org_snapshot
from .state import BURST, MIN_RETRY_NS, Authorizer, Key, Pending, Wire, WorkerState, checked
from .usage import UsageIntake
from .workers import WorkerTable

log = logging.getLogger(__name__)

__all__ = ["Authorizer", "Broker", "Key", "Pending", "WorkerState"]


def _request_payload(frames: list[object]) -> int | None:
    """Where a client's request payload is: [client, IBX2, REQUEST, header, payload] or [client, IBX2,
    CORRELATED, correlation_id, header, payload]."""
    if len(frames) == 5 and frames[2] == P.REQUEST:
        return 4
    return 5 if len(frames) == 6 and frames[2] == P.CORRELATED else None


def _reply_payload(frames: list[object]) -> int | None:
    """Where a worker's reply payload is: [worker, IBX2, REPLY | ERROR, client, request_id, payload(, feedback)]."""
    return 5 if len(frames) in (6, 7) and frames[2] in (P.REPLY, P.ERROR) else None


class _Unpaced:
    """The orgs the fair queue must skip now (``FairQueue.pop``): those ``held`` back by their own
    held slots, and, under a limited dispatch rate, those whose request costs more tokens than
    the bucket holds (``paced`` records that one was). O(1) per org asked."""

    __slots__ = ("cost", "held", "light", "paced", "rate")

    def __init__(self, held: Container[str], rate: DispatchRate, cost: MemoryCost,
                 light: Callable[[str], bool] | None = None) -> None:
        self.held, self.rate, self.cost, self.paced, self.light = held, rate, cost, False, light

    def __contains__(self, org: object) -> bool:
        if org in self.held:
            return True
        if isinstance(org, str) and not self.rate.allows(self.cost.cost(org)):
            if self.light is not None and self.light(org):  # a light org goes ahead of its token
                return False
            self.paced = True
            return True
        return False


class Broker:
    """The request table (pending requests, the fair queue, deadline timers) and the loop; the
    workers live in ``self.table`` (``broker.workers``), the report path in ``self.usage``
    (``broker.usage``), the sends in ``self.wire`` (``broker.state``)."""

    def __init__(self, *, settings: BrokerSettings, frontend: str | None = None, backend: str | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None, authorizer: Authorizer | None = None,
                 configure_frontend: Callable[[zmq.Socket[bytes]], None] | None = None,
                 configure_backend: Callable[[zmq.Socket[bytes]], None] | None = None) -> None:
        self.settings = settings
        self.ctx = ctx or zmq.Context.instance()
        self.authorizer = authorizer
        self.front = self._socket(configure_frontend, P.frontend_max_msgsize(settings.max_request_bytes))
        self.back = self._socket(configure_backend,
                                 P.backend_max_msgsize(settings.max_request_bytes, settings.max_reply_bytes))
        self.front.bind(frontend or settings.broker_frontend)
        self.back.bind(backend or settings.broker_backend)
        self.frontend_endpoint = self.front.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self.backend_endpoint = self.back.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self.back_monitor = self.back.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poll_items: list[tuple[zmq.Socket[bytes], int]] = [
            (s, zmq.POLLIN) for s in (self.front, self.back, self.back_monitor)]
        self.stats: collections.Counter[str] = collections.Counter()
        self.wire = Wire(self.front, self.back, self.stats)
        self.table = WorkerTable(settings, self.wire, self.stats)
        self.queue: FairQueue[Key] = FairQueue(settings.org_weight_map())  # per-org FIFOs, weighted fair order
        self.usage = UsageIntake(settings, self.wire, self.table, self.queue, self.stats, authorizer)
        self.org_shed = TopCounts()  # requests refused OVERLOADED on receipt or pushed out, per org
        self.pending: dict[Key, Pending] = {}
        self.timers: list[tuple[int, int, Key]] = []  # (deadline_ns, attempt, key)
        self.service = ServiceTime()  # dispatch-to-reply time, for the queue-wait estimate
        self.admission_queue_ns = settings.admission_queue_ms * 1e6
        self.standing: dict[str, StandingQueue] = {}  # per org with requests queued: CoDel's standing-queue test
        self.holds = Holds()  # slots held for their org after fast degraded replies (IBEX_ADMISSION_HOLD)
        self.rate = DispatchRate()  # the memory service's pace, learned from the replies (IBEX_ADMISSION_RATE)
        self.cost = MemoryCost()  # per org, the tokens one of its requests takes
        self.light = LightOrgs()  # per org, the tokens it took lately: a light org goes without waiting for one
        self.running = True
        self.observe_queue_wait: Callable[[float], None] | None = None  # metrics hook (seconds)

    def _socket(self, configure: Callable[[zmq.Socket[bytes]], None] | None, max_msgsize: int) -> zmq.Socket[bytes]:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, P.SNDHWM)
        s.setsockopt(zmq.RCVHWM, P.RCVHWM)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, max_msgsize)
        if configure is not None:
            configure(s)
        return s

    # ----------------------------------------------------------------------------- main loop

    def serve_forever(self) -> None:
        log.info("broker frontend %s backend %s", self.frontend_endpoint, self.backend_endpoint)
        while self.running:
            self.poll_once()
        self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        for key in list(self.pending):
            self._answer_error(key, Unavailable("broker is shutting down"))
        self.back.disable_monitor()
        for s in (self.back_monitor, self.front, self.back):
            s.close(linger=0)

    def _drain_backend(self, limit: int | None, *, polled: bool = False) -> None:
        """Handle waiting worker messages: at most ``limit`` (None: every one waiting). ``polled``:
        the poll just reported one waiting, so the first is read without asking again (each
        ``readable`` is a getsockopt of ~1 µs, two per request otherwise)."""
        n = 0
        while (limit is None or n < limit) and ((polled and n == 0) or readable(self.back)):
            self._on_backend(recv_forwarding(self.back, _reply_payload)[0])
            n += 1

    def poll_once(self) -> None:
        now = time.monotonic_ns()
        timeout_ms = max(0, (self._wake_ns(now) - now + 999_999) // 1_000_000)
        ready = {sock for sock, _ in zmq.zmq_poll(self.poll_items, min(timeout_ms, 100))}
        if self.back in ready:
            self._drain_backend(BURST, polled=True)
        if self.back_monitor in ready:
            # A worker's last replies reach its pipe before its disconnect event: read them all
            # first, or the probe would call it lost and re-dispatch what it had answered.
            self._drain_backend(None)
            self._on_monitor()
        if self.front in ready:
            for i in range(BURST):
                if i and not readable(self.front):  # the poll said one message waits: no need to ask
                    break
                self._on_frontend(*recv_forwarding(self.front, _request_payload))
        now = time.monotonic_ns()
        if self.timers and self.timers[0][0] <= now:
            self._expire(now)
        if now >= self.table.next_check_ns:
            for w, why in self.table.heartbeat(now):
                self._worker_dead(w, why)
        if self.queue:
            self._dispatch()

    def _wake_ns(self, now: int) -> int:
        """When the loop must run even if no message comes: the next heartbeat, deadline, or end of
        a hold (it may let its org's queued requests go)."""
        wake = min(self.table.next_hb_ns, self.timers[0][0] if self.timers else now + 100_000_000)
        if self.queue and self.holds:
            self.holds.expire(now)  # an end already past must not wake the loop again at once
            wake = min(wake, self.holds.next_end_ns() or wake)
        if self.queue and self.rate.limited and self.rate.binding(now):
            wake = min(wake, self.rate.next_token_ns(1.0, now))
        return wake

    # ------------------------------------------------------------------------------ frontend

    def _on_frontend(self, msg: list[bytes], last: zmq.Frame) -> None:
        self.stats["frontend_messages"] += 1
        if len(msg) < 2:
            self.stats["dropped_unroutable"] += 1
            return
        client = msg[0]
        try:
            parsed = P.parse_client_message(msg[1:])
        except P.FrameError as exc:
            self.stats["rejected_malformed_frames"] += 1
            self.wire.reply_error(client, b"", InvalidRequest(str(exc), field="<frames>"))
            return
        if isinstance(parsed, P.StatusRequest):
            self.wire.send_front([client, *P.status_reply_frames(self.snapshot())])
            return
        if isinstance(parsed, P.UsageMessage | P.SummaryMessage):
            if self.queue:
                self._dispatch()  # requests waiting for a worker go before any report or summary
            self.usage.on_report(client, parsed.payload, last,
                                 "usage" if isinstance(parsed, P.UsageMessage) else "summary")
            return
        header, req = self._envelope(parsed)
        # replies are matched by the client's correlation id; a REQUEST has none: its request_id
        correlation_id = parsed.correlation_id or (req.request_id or "").encode()
        if isinstance(req, ErrorReply):
            self.stats["rejected_invalid"] += 1
            self.wire.reply_error(client, correlation_id, req)
            return
        key = (client, correlation_id)
        refusal = self._refusal(key, req, last)
        if refusal is not None:
            self.stats[refusal[0]] += 1
            if refusal[1].code is ErrorCode.OVERLOADED:
                self.org_shed.add(req.org_id)
            self.wire.reply_error(client, correlation_id, refusal[1], req.request_id)
            return
        self._enqueue(key, req, header, parsed.payload)

    def _envelope(self, parsed: P.ClientRequest) -> tuple[bytes, Envelope | ErrorReply]:
        """(header frame, routing fields) of a request. With a header frame the payload is never
        read here (its size aside); the worker checks it agrees with the header."""
        limit = self.settings.max_request_bytes
        env = parse_header(parsed.header)
        if not isinstance(env, ErrorReply) and len(parsed.payload) > limit:
            env = ErrorReply(request_id=env.request_id, code=ErrorCode.INVALID_REQUEST, field="<payload>",
                             message=f"payload of {len(parsed.payload)} bytes exceeds the limit of {limit} bytes")
        return parsed.header, env

    def _refusal(self, key: Key, req: Envelope, last: zmq.Frame) -> tuple[str, IbexError] | None:
        """(counter, error) when a well-formed request must be answered at once, else None."""
        first = checked(req, last, self.authorizer)
        if first is not None:
            return first
        remaining = req.deadline_ns - time.time_ns()
        if key in self.pending:  # only a client that sent no correlation id can repeat one
            return "rejected_duplicate", InvalidRequest(
                f"request_id {req.request_id!r} is already in flight from this client", field="request_id")
        refusal = self._shed(req.org_id, remaining) or self._gates_full(req.org_id)
        if refusal is None and len(self.queue) >= self.settings.queue_max:
            refusal = self._full(req.org_id)
        return refusal

    def _shed(self, org: str, remaining_ns: int) -> tuple[str, IbexError] | None:
        """OVERLOADED on receipt when the request could not be answered in full (broker/admission.py):
        its wait behind its own org's queue at its org's share of the slots, or of the dispatch rate
        while that is limited, and a service time would not fit its deadline, or that queue is
        standing and the wait is over the target. Another org's backlog does not count. Refused
        now, the caller falls back now."""
        queued = self.queue.queued(org)
        held = 0
        if self.holds:
            self.holds.expire(time.monotonic_ns())
            held = self.holds.held(org)
            if held and (refusal := self._shed_held(org, held, queued, remaining_ns)) is not None:
                return refusal
        now = time.monotonic_ns()
        if not queued:
            self._drained(org, now)  # a standing queue never empties, and only the rate sheds the first
        if not self.admission_queue_ns or not self.table:
            return None
        return self._shed_wait(org, queued, held, remaining_ns, now)

    def _shed_wait(self, org: str, queued: int, held: int, remaining_ns: int, now: int) -> tuple[str, IbexError] | None:
        """``_shed`` for a request of ``org`` behind ``queued`` of its own, ``held`` slots held for it."""
        share = self.queue.share(org) if queued else 1.0  # first of its org: it goes at the next token
        rate_wait = self._rate_wait(org, queued, share, now)
        trusted = self.service.trusted
        service = self.service.mean_ns if trusted else 0.0  # untrusted: the token wait alone is known
        if not queued and (not rate_wait or rate_wait + service < remaining_ns):
            return None
        standing = self.standing.get(org)
        is_standing = trusted and standing is not None and standing.standing(now)
        if not is_standing and not rate_wait:
            return None
        live = self.table.live()
        slots = sum(w.slots for w in live)
        free = max(0, sum(max(0, w.free) for w in live) - held)  # its own held slots are not free for it
        wait = max(rate_wait, expected_wait_ns(queued, slots, free, service, share) if trusted else 0.0)
        if is_standing:
            if not shed(wait_ns=wait, service_ns=service, remaining_ns=remaining_ns,
                        target_ns=self.admission_queue_ns, standing=True):
                return None
        elif rate_wait + service < remaining_ns:  # the rate binds: its turn is known, standing or not
            return None
        if rate_wait >= wait:
            return "shed_rate", Overloaded(
                f"shed on receipt: about {wait / 1e6:.1f} ms behind {queued} queued request(s) of org {org!r} at its "
                f"share of the memory service's pace ({self.rate.rate * share:.1f} of {self.rate.rate:.1f} per s), "
                f"and {service / 1e6:.1f} ms of service; retry with backoff or another broker")
        return "shed_overloaded", Overloaded(
            f"shed on receipt: about {wait / 1e6:.1f} ms behind {queued} queued request(s) of org {org!r} at its "
            f"share of {slots * share:.1f} of {slots} slot(s), and {service / 1e6:.1f} ms of service; "
            f"retry with backoff or another broker")

    def _rate_wait(self, org: str, queued: int, share: float, now_ns: int) -> float:
        """How long a request of ``org`` arriving behind ``queued`` of its own waits for its tokens
        at its org's ``share`` of the dispatch rate (``broker.admission.DispatchRate``); 0 while
        the rate is off, lifted, or the org's requests take no tokens."""
        if not self.settings.admission_rate or not self.rate.limited:
            return 0.0
        self.rate.refill(now_ns)
        cost = self.cost.cost(org)
        if cost <= 0 or not self.rate.limited:
            return 0.0
        if not queued and self.settings.admission_light and self._light(org):
            return 0.0  # it goes at once, ahead of its token
        return self.rate.wait_ns((queued + 1) * cost, share, now_ns)

    def _shed_held(self, org: str, held: int, queued: int, remaining_ns: int) -> tuple[str, IbexError] | None:
        """OVERLOADED on receipt when ``org``'s own held slots take every free slot and the first of
        them to end, and then a service time, would not fit the request's deadline: it is known now
        that it cannot be answered in full, queue standing or not (a closed-loop caller sends its
        next request only when the last is answered, so its queue never stands)."""
        if not self.service.trusted or not self.admission_queue_ns:
            return None
        live = self.table.live()
        if held < sum(max(0, w.free) for w in live):
            return None
        now = time.monotonic_ns()
        service = self.service.mean_ns
        wait = max(self.holds.first_end_ns(org) - now,
                   expected_wait_ns(queued, sum(w.slots for w in live), 0, service, self.queue.share(org)))
        if wait + service < remaining_ns:
            return None
        return "shed_held", Overloaded(
            f"shed on receipt: org {org!r} holds {held} slot(s) after replies degraded at once (the memory service "
            f"refusing its calls), the next free in {wait / 1e6:.1f} ms, and {service / 1e6:.1f} ms of service would "
            f"end after the deadline; retry with backoff or another broker")

    def _gates_full(self, org: str) -> tuple[str, IbexError] | None:
        """OVERLOADED on receipt while every worker's memory gate is full (``worker.memgate``, told in
        each reply's feedback) and ``org`` holds at least an equal share of the requests in flight:
        a worker's gate would answer it without memories after a hop, at a worker's CPU. An org
        under its share goes on to a worker, where the gate keeps it a slot."""
        live = self.table.live()
        if not live or not all(w.gate_full and w.inflight for w in live):
            return None
        held = collections.Counter(self.pending[k].org for w in live for k in w.inflight if k in self.pending)
        total, mine = sum(held.values()), held.get(org, 0)
        if mine * (1 + sum(1 for o in held if o != org)) < total:
            return None
        return "shed_gates_full", Overloaded(
            f"every worker's limit on memory-service calls is full and org {org!r} holds {mine} of the {total} "
            f"request(s) in flight; retry with backoff or another broker")

    def _full(self, org: str) -> tuple[str, IbexError] | None:
        """The queue holds ``queue_max``: an arrival of an org under its share of the queue takes
        the place of the newest request of the org most over its share, which is answered
        OVERLOADED (``FairQueue.push_out``); an arrival at or over its share is refused itself."""
        out = self.queue.push_out(org, self.settings.queue_max)
        if out is None:
            return "rejected_overloaded", Overloaded(
                f"broker queue is full ({self.settings.queue_max} waiting) and org {org!r} holds its share of it; "
                f"retry with backoff or another broker")
        victim, key = out
        self._left_queue(victim)
        self.stats["pushed_out"] += 1
        self.org_shed.add(victim)
        self._answer_error(key, Overloaded(
            f"pushed out of the full broker queue ({self.settings.queue_max} waiting) by a request of an org under "
            f"its share; org {victim!r} holds the most for its weight; retry with backoff or another broker"))
        return None

    def _enqueue(self, key: Key, req: Envelope, header: bytes, payload: bytes) -> None:
        now_ns = time.monotonic_ns()
        remaining = req.deadline_ns - time.time_ns()  # epoch -> monotonic, once, on receipt
        p = Pending(key, req.request_id, req.org_id, header, payload, req.deadline_ns, now_ns + remaining, now_ns)
        self.pending[key] = p
        self.queue.push(req.org_id, key)
        heapq.heappush(self.timers, (p.deadline_ns, p.attempt, key))
        self.stats["accepted"] += 1

    # ------------------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        """Queued requests to free slots, in the fair queue's order (``broker.fairqueue``); with
        ``IBEX_ADMISSION_LIFO`` an org whose queue stands gives its newest request first (adaptive
        LIFO), and its oldest ones that can no longer be answered in full are refused first."""
        lifo: set[str] = set()
        if self.standing and self.settings.admission_lifo:
            now = time.monotonic_ns()
            self._drop_stale(now)
            lifo = {org for org, sq in self.standing.items() if sq.standing(now)}
        rate = self.rate if self.settings.admission_rate else None
        while self.queue:
            w = self.table.pick()
            if w is None:
                return
            nxt = self._next(lifo, rate)
            if nxt is None:
                return
            org, key = nxt
            p = self.pending.get(key)
            if p is None or p.answered or p.worker is not None:
                self._left_queue(org)
                continue
            now = time.monotonic_ns()
            self._waited(org, now - p.enqueued_ns, now)
            if now >= p.deadline_ns:
                self.stats["expired_at_dispatch"] += 1
                self._answer_error(key, DeadlineExceeded(
                    f"deadline passed after {(now - p.enqueued_ns) / 1e6:.2f} ms in the broker queue"))
                continue
            stamp = P.Stamp(p.deadline_epoch_ns, (now - p.enqueued_ns) // 1000, time.time_ns(), p.attempt)
            if not self.wire.send_back([w.ident, *P.dispatch_frames(key[0], key[1], stamp, p.header, p.payload)]):
                self._worker_dead(w, "send failed")
                self.queue.push_front(org, key)
                continue
            p.worker, p.dispatched_ns = w.ident, now
            self.table.dispatched(w, key)
            self.stats["dispatched"] += 1
            if rate is not None:
                self._took(rate, org, now)
            if self.observe_queue_wait is not None:
                self.observe_queue_wait((now - p.enqueued_ns) / 1e9)

    def _next(self, lifo: set[str], rate: DispatchRate | None) -> tuple[str, Key] | None:
        """The next (org, request) in fair order that may go now: not of an org whose held slots
        take every free slot, nor, under a limited dispatch rate, one whose request costs more
        tokens than the bucket holds (the rate then binds)."""
        held = self._held_back()
        if rate is not None:
            rate.refill(time.monotonic_ns())
        if rate is None or not rate.limited:
            return self.queue.pop(lifo, held)
        skip = _Unpaced(held, rate, self.cost, self._light if self.settings.admission_light else None)
        nxt = self.queue.pop(lifo, skip)
        if nxt is None and skip.paced:
            rate.held_back(time.monotonic_ns())
        return nxt

    def _took(self, rate: DispatchRate, org: str, now_ns: int) -> None:
        """A request of ``org`` was dispatched: its tokens taken (ahead of them, for a light org, and
        ``IBEX_ADMISSION_LIGHT_HEADROOM`` more while a heavier org has work queued, which it goes without)."""
        cost = self.cost.cost(org)
        if rate.limited and not rate.allows(cost):
            self.stats["rate_lent"] += 1
        s = self.settings
        headroom = rate.limited and cost > 0 and s.admission_light and s.admission_light_headroom > 0 \
            and takes_headroom(org, self.queue.fullest_org(), self._light, functools.partial(self._use, now_ns))
        rate.take(tokens_taken(cost, light=headroom, headroom=s.admission_light_headroom), now_ns)
        if headroom:
            self.stats["rate_headroom"] += 1
        self.light.took(org, cost, now_ns)

    def _light(self, org: str) -> bool:
        """Whether ``org`` uses under ``LIGHT_SHARE`` of its share of the dispatch rate (``admission.LightOrgs``)."""
        return self.light.light(org, self.rate.rate, self.queue.share(org), time.monotonic_ns())

    def _use(self, now_ns: int, org: str) -> float:
        """The dispatch tokens ``org`` took lately, per unit of its weight."""
        return self.light.used(org, now_ns) / self.queue.weight(org)

    def _held_back(self) -> set[str]:
        """The orgs whose own held slots (``broker.admission.Holds``) take every free slot now:
        none of their requests is dispatched until a hold ends; every other org may use them all."""
        if not self.holds:
            return set()
        self.holds.expire(time.monotonic_ns())
        return self.holds.blocked(sum(max(0, w.free) for w in self.table.live()))

    def _waited(self, org: str, waited_ns: int, now_ns: int) -> None:
        """A request of ``org`` leaves the queue after ``waited_ns``: the org's standing-queue test
        (kept while it has more queued, or while it stood lately) learns it, or the age of the
        org's oldest queued request if that is more (served newest first, the dispatched ones
        are fresh while the queue still stands)."""
        oldest = self.queue.oldest(org)
        if oldest is None:
            self._drained(org, now_ns)
            return
        p = self.pending.get(oldest)
        if p is not None:
            waited_ns = max(waited_ns, now_ns - p.enqueued_ns)
        sq = self.standing.get(org)
        if sq is None:
            sq = self.standing[org] = StandingQueue(self.admission_queue_ns)
        sq.on_dispatch(waited_ns, now_ns)

    def _drop_stale(self, now_ns: int) -> None:
        """With an org's queue standing (served newest first), its oldest requests that can no
        longer be answered in full (less time left than a service time and the target) are
        answered OVERLOADED now, instead of waiting on to their deadline behind newer ones; one
        with time to spare waits on (it goes when the queue drains)."""
        if not self.service.trusted:
            return
        need_ns = self.service.mean_ns + STALE_FACTOR * self.admission_queue_ns
        for org, sq in list(self.standing.items()):
            if not sq.standing(now_ns):
                continue
            while (key := self.queue.oldest(org)) is not None:
                p = self.pending.get(key)
                waited = now_ns - p.enqueued_ns if p is not None else 0
                if p is not None and p.deadline_ns - now_ns >= need_ns:
                    break
                self.queue.remove(org, key)
                if p is None or p.answered or p.worker is not None:
                    continue
                self.stats["shed_stale"] += 1
                self.org_shed.add(org)
                self._answer_error(key, Overloaded(
                    f"shed after {waited / 1e6:.1f} ms in the standing queue of org {org!r} (served newest first) "
                    f"with too little time left to be answered in full; retry with backoff or another broker"))
            if not self.queue.queued(org):
                self._drained(org, now_ns)  # remembered: it stood just now

    def _drained(self, org: str, now_ns: int) -> None:
        """``org``'s queue is empty: its standing-queue test restarts, and is forgotten unless the
        queue stood lately (``StandingQueue.remembered``)."""
        sq = self.standing.get(org)
        if sq is None:
            return
        sq.reset()
        if not sq.remembered(now_ns):
            del self.standing[org]

    # ------------------------------------------------------------------------------- backend

    def _on_backend(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != P.TAG:
            self.stats["backend_malformed"] += 1
            return
        ident = frames[0]
        w = self.table.heard(ident)
        try:
            msg = P.parse_worker_message(frames[1:])
        except P.FrameError as exc:
            self.stats["backend_malformed"] += 1
            log.debug("malformed worker message: %s", exc)
            return
        if isinstance(msg, P.WorkerReply):
            self._on_reply(ident, msg)
        elif isinstance(msg, P.WorkerHeartbeat | P.WorkerReady):
            info = msg.info
            if info is not None:
                reconnected = self.table.on_ready(ident, w, info, from_heartbeat=isinstance(msg, P.WorkerHeartbeat))
                if reconnected is not None:
                    self._recover(reconnected, "reconnected")
        else:
            self.table.on_disconnect(ident, w)

    def _on_reply(self, ident: bytes, reply: P.WorkerReply) -> None:
        client, correlation_id = reply.client, reply.request_id
        key = (client, correlation_id)
        p = self.pending.get(key)
        w = self.table.get(ident)
        if w is not None:
            if p is not None and p.worker == ident:
                self._learn(w, p, reply.feedback)
            self.table.release(w, key)
        if p is None or p.worker != ident:
            self.stats["late_or_unknown_reply"] += 1  # re-dispatched elsewhere, or already answered
            return
        del self.pending[key]
        if p.answered:
            self.stats["late_reply_after_deadline"] += 1
            return
        if time.monotonic_ns() >= p.deadline_ns:
            self.stats["late_reply_after_deadline"] += 1
            self.wire.reply_error(client, correlation_id, DeadlineExceeded("worker replied after the deadline"),
                                  p.request_id)
            return
        self.stats["replies" if reply.cmd == P.REPLY else "worker_errors"] += 1
        self.wire.send_front([client, *P.reply_frames(reply.cmd, correlation_id, reply.payload)])

    def _learn(self, w: WorkerState, p: Pending, feedback: P.Feedback | None) -> None:
        """Admission control's inputs from one reply: its service time, and the worker's signals.
        A reply served in full times the service, and so does a degraded one that held its slot a
        service time or more (cut at a branch's limit); a degraded one back sooner (refused at the
        memory gate or by the memory service, or a branch skipped for lack of time) would make the
        queue look faster than the answers it is meant to admit: with ``IBEX_ADMISSION_HOLD`` its
        slot stays held for its org until a service time has passed since its dispatch."""
        now = time.monotonic_ns()
        overloaded = feedback is not None and feedback.overloaded
        took = now - p.dispatched_ns
        if counts_in_service(took_ns=took, service_ns=self.service.mean_ns, overloaded=overloaded):
            self.service.observe(took)
        if self.settings.admission_hold and self.service.trusted:
            until = hold_until_ns(dispatched_ns=p.dispatched_ns, now_ns=now, service_ns=self.service.mean_ns,
                                  overloaded=overloaded)
            if until is not None:
                self.holds.hold(p.org, until)
                self.stats["held_slots_given"] += 1
        if feedback is not None:
            w.gate_full = feedback.gate_full
            self.cost.observe(p.org, feedback.memory)
            if self.settings.admission_rate:
                cuts = self.rate.cuts
                self.rate.on_reply(dispatched_ns=p.dispatched_ns, now_ns=now, refused=feedback.refused,
                                   clean=not overloaded, asked_memory=feedback.memory)
                if self.rate.cuts != cuts:
                    self.stats["rate_cuts"] += 1
        if w.limiter is not None and feedback is not None:
            w.limiter.on_reply(inflight=len(w.inflight), overloaded=feedback.overloaded,
                               loop_lag_us=feedback.loop_lag_us, now_ns=now, service_ns=self.service.mean_ns)

    def _on_monitor(self) -> None:
        try:
            while True:
                ev = recv_monitor_message(self.back_monitor, zmq.NOBLOCK)
                log.debug("backend event %s", ev)
                if ev["event"] == zmq.EVENT_DISCONNECTED:
                    self.stats["backend_disconnects"] += 1
                    for w, why in self.table.probe():
                        self._worker_dead(w, why)
        except zmq.Again:
            return

    def _worker_dead(self, w: WorkerState, why: str) -> None:
        if not self.table.remove(w):
            return
        log.warning("worker %s lost (%s); %d request(s) in flight", w.worker_id, why, len(w.inflight))
        self._recover(w, why)

    def _recover(self, w: WorkerState, why: str) -> None:
        """Requests held by a lost (or reconnected) worker: re-dispatch while time allows, else
        UNAVAILABLE; records already answered are dropped. Either way the worker holds none."""
        now = time.monotonic_ns()
        held, w.inflight, w.gate_full = w.inflight, set(), False
        for key in sorted(held, key=lambda k: self.pending[k].deadline_ns if k in self.pending else 0,
                          reverse=True):
            p = self.pending.get(key)
            if p is None:
                continue
            if p.answered:
                del self.pending[key]
            elif p.deadline_ns - now > MIN_RETRY_NS:
                p.worker, p.attempt = None, p.attempt + 1
                heapq.heappush(self.timers, (p.deadline_ns, p.attempt, key))
                self.queue.push_front(p.org, key)
                self.stats["redispatched"] += 1
            else:
                self._answer_error(key, Unavailable(
                    f"worker {w.worker_id} was lost ({why}) with no time left to retry"))

    # ------------------------------------------------------------------------ deadlines

    def _expire(self, now: int) -> None:
        while self.timers and self.timers[0][0] <= now:
            _, attempt, key = heapq.heappop(self.timers)
            p = self.pending.get(key)
            if p is None or p.attempt != attempt:
                continue
            if p.answered:  # answered at its deadline; the worker never replied within the grace
                self._reap(p)
            elif p.worker is None:
                self.stats["expired_in_queue"] += 1
                self.queue.remove(p.org, key)
                self._left_queue(p.org)
                self._answer_error(key, DeadlineExceeded(
                    f"deadline passed after {(now - p.enqueued_ns) / 1e6:.2f} ms waiting in the broker queue"))
            else:  # the worker still holds it: answer now, keep the record until the worker frees credit
                self.stats["expired_in_worker"] += 1
                p.answered = True
                self.wire.reply_error(key[0], key[1], DeadlineExceeded("deadline passed while a worker was assembling"),
                                      p.request_id)
                # Keep the record (it holds the worker's credit) until the late reply comes, but not
                # for ever: a reply lost on the way must not leave pending/inflight stuck.
                heapq.heappush(self.timers, (now + self.table.grace_ns, p.attempt, key))

    def _reap(self, p: Pending) -> None:
        del self.pending[p.key]
        w = self.table.get(p.worker) if p.worker is not None else None
        if w is not None:
            w.inflight.discard(p.key)
            w.gate_full = w.gate_full and bool(w.inflight)
        self.stats["reaped_no_reply"] += 1
        log.warning("no reply from worker %s for request %s within %d ms of its deadline; freeing its credit",
                    w.worker_id if w else "?", p.request_id, self.table.grace_ns // 1_000_000)

    # ------------------------------------------------------------------------ shared state

    def _answer_error(self, key: Key, exc: IbexError) -> None:
        p = self.pending.pop(key, None)
        self.wire.reply_error(key[0], key[1], exc, p.request_id if p is not None else None)

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
        if orgs:  # the metrics thread (orgs=False) only reads: the broker's thread expires holds
            self.holds.expire(time.monotonic_ns())
            self.rate.refill(time.monotonic_ns())  # a rate a quiet spell has lifted shows as lifted
        snap: dict[str, object] = {
            "pid": os.getpid(),
            "queue_depth": len(self.queue),
            "pending": len(self.pending),
            "slots_held": len(self.holds),
            "dispatch_rate": round(self.rate.rate, 1) if self.rate.limited else None,
            "workers": self.table.snapshot(),
            "stats": dict(self.stats),
        }
        if orgs:
            inflight = (p.org for p in self.pending.values() if p.worker is not None and not p.answered)
            snap |= org_snapshot(self.queue.queued_by_org(), inflight, self.org_shed, self.holds.by_org.items())
        return snap
