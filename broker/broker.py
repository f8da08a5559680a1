"""The load-balancing broker: ROUTER frontend for clients, ROUTER backend for workers.

Design (zguide load-balancing broker + Paranoid Pirate, with gRPC-style deadlines):

* The frontend is drained continuously into the broker's own bounded queue, so backlog never hides
  in socket buffers; when the queue is full the client hears OVERLOADED at once.
* Credit-based dispatch: each worker announces its capacity (requests it can hold in flight; its
  retrieval is I/O-bound). A request goes to the live worker with most free credit.
* Deadlines: the wire carries absolute Unix-epoch ns; they are converted once, on receipt, to local
  monotonic ns. Expired requests are dropped at receipt, in the queue and at dispatch, counted by
  reason, and the client is told DEADLINE_EXCEEDED. A request whose deadline passes while a worker
  holds it is answered DEADLINE_EXCEEDED by the broker; the worker's late reply only frees credit.
* Liveness: heartbeats both ways; a backend disconnect event triggers an immediate probe
  (ROUTER_MANDATORY makes a send to a vanished peer fail with EHOSTUNREACH). Requests in flight on a
  dead worker are re-dispatched if their deadline still allows (assembly is read-only), else
  answered UNAVAILABLE. Every request ends in exactly one reply.

Single-threaded and synchronous on purpose: the broker does no I/O but sockets, and one thread with
a poller has no locks and no scheduling surprises.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from ibex_context.shared import protocol as P
from ibex_context.shared.codec import Envelope, encode_error, peek_envelope
from ibex_context.shared.errors import DeadlineExceeded, IbexError, InvalidRequest, Overloaded, Unavailable
from ibex_context.shared.loopsock import readable, recv_frames, recv_message, send_frames
from ibex_context.shared.models import ErrorReply
from ibex_context.shared.settings import Settings

log = logging.getLogger(__name__)

Key = tuple[bytes, str]  # (client routing id, request_id)
MIN_RETRY_NS = 2_000_000  # re-dispatch only with at least 2 ms left
BURST = 256  # frontend messages drained per poll round

# Authorizer hook: given the frontend frame's auth metadata and the request's envelope, raise
# Forbidden/Unauthenticated or return. Wired by the CURVE/ZAP layer; None means no caller auth
# (loopback only).
Authorizer = Callable[[zmq.Frame, Envelope], None]


@dataclass(slots=True)
class Pending:
    key: Key
    payload: bytes
    deadline_epoch_ns: int
    deadline_ns: int  # local monotonic
    enqueued_ns: int
    attempt: int = 1
    worker: bytes | None = None
    answered: bool = False


@dataclass(slots=True)
class WorkerState:
    ident: bytes
    worker_id: str
    capacity: int
    expiry_ns: int
    inflight: set[Key] = field(default_factory=set)
    draining: bool = False
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return 0 if self.draining else self.capacity - len(self.inflight)


class Broker:
    def __init__(self, *, settings: Settings, frontend: str | None = None, backend: str | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None, authorizer: Authorizer | None = None,
                 configure_frontend: Callable[[zmq.Socket[bytes]], None] | None = None,
                 configure_backend: Callable[[zmq.Socket[bytes]], None] | None = None) -> None:
        self.settings = settings
        self.ctx = ctx or zmq.Context.instance()
        self.authorizer = authorizer
        self.hb_ns = settings.heartbeat_interval_ms * 1_000_000
        self.liveness = settings.heartbeat_liveness
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
        self.queue: collections.deque[Key] = collections.deque()
        self.pending: dict[Key, Pending] = {}
        self.timers: list[tuple[int, int, Key]] = []  # (deadline_ns, attempt, key)
        self.workers: dict[bytes, WorkerState] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self.next_hb_ns = time.monotonic_ns() + self.hb_ns
        self.next_check_ns = 0  # next worker-liveness check (a tenth of an interval apart, not every poll)
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

    def poll_once(self) -> None:
        now = time.monotonic_ns()
        wake = min(self.next_hb_ns, self.timers[0][0] if self.timers else now + 100_000_000)
        timeout_ms = max(0, (wake - now + 999_999) // 1_000_000)
        ready = {sock for sock, _ in zmq.zmq_poll(self.poll_items, min(timeout_ms, 100))}
        if self.back_monitor in ready:
            self._on_monitor()
        if self.back in ready:
            for _ in range(BURST):
                if not readable(self.back):
                    break
                self._on_backend(recv_frames(self.back))
        if self.front in ready:
            for _ in range(BURST):
                if not readable(self.front):
                    break
                self._on_frontend(*recv_message(self.front))
        now = time.monotonic_ns()
        if self.timers and self.timers[0][0] <= now:
            self._expire(now)
        if now >= self.next_check_ns:
            self._heartbeat(now)
        if self.queue:
            self._dispatch()

    # ------------------------------------------------------------------------------ frontend

    def _on_frontend(self, msg: list[bytes], last: zmq.Frame) -> None:
        self.stats["frontend_messages"] += 1
        if len(msg) < 2:
            self.stats["dropped_unroutable"] += 1
            return
        client = msg[0]
        frames = msg[1:]
        if len(frames) == 2 and frames[0] == P.TAG and frames[1] == P.STATUS:
            self._send_front([client, P.TAG, P.REPLY, b"", msgpack.packb(self.snapshot())])
            return
        if len(frames) != 3 or frames[0] != P.TAG or frames[1] != P.REQUEST:
            self.stats["rejected_malformed_frames"] += 1
            self._reply_error(client, None, InvalidRequest(
                f"expected frames [{P.TAG!r}, REQUEST, payload], got {len(frames)} frame(s)", field="<frames>"))
            return
        # Route on the envelope only; the worker validates the whole request (issue 9: full
        # validation here cost ~25 µs of the broker's budget per request, for nothing it needs).
        req = peek_envelope(frames[2], max_bytes=self.settings.max_request_bytes)
        if isinstance(req, ErrorReply):
            self.stats["rejected_invalid"] += 1
            self._reply_error(client, req.request_id, req)
            return
        now_ns = time.monotonic_ns()
        remaining = req.deadline_ns - time.time_ns()  # epoch -> monotonic, once, on receipt
        if remaining <= 0:
            self.stats["expired_at_receipt"] += 1
            self._reply_error(client, req.request_id, DeadlineExceeded(
                f"deadline passed {-remaining / 1e6:.2f} ms before the broker received the request"))
            return
        if self.authorizer is not None:
            try:
                self.authorizer(last, req)
            except IbexError as exc:
                self.stats[f"rejected_{exc.code.value.lower()}"] += 1
                self._reply_error(client, req.request_id, exc)
                return
        key = (client, req.request_id)
        if key in self.pending:
            self.stats["rejected_duplicate"] += 1
            self._reply_error(client, req.request_id, InvalidRequest(
                f"request_id {req.request_id!r} is already in flight from this client", field="request_id"))
            return
        if len(self.queue) >= self.settings.queue_max:
            self.stats["rejected_overloaded"] += 1
            self._reply_error(client, req.request_id, Overloaded(
                f"broker queue is full ({self.settings.queue_max} waiting); retry with backoff or another broker"))
            return
        p = Pending(key, frames[2], req.deadline_ns, now_ns + remaining, now_ns)
        self.pending[key] = p
        self.queue.append(key)
        heapq.heappush(self.timers, (p.deadline_ns, p.attempt, key))
        self.stats["accepted"] += 1

    # ------------------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        while self.queue:
            w = self._pick_worker()
            if w is None:
                return
            key = self.queue.popleft()
            p = self.pending.get(key)
            if p is None or p.answered or p.worker is not None:
                continue
            now = time.monotonic_ns()
            if now >= p.deadline_ns:
                self.stats["expired_at_dispatch"] += 1
                self._answer_error(key, DeadlineExceeded(
                    f"deadline passed after {(now - p.enqueued_ns) / 1e6:.2f} ms in the broker queue"))
                continue
            stamp = P.Stamp(p.deadline_epoch_ns, (now - p.enqueued_ns) // 1000, time.time_ns(), p.attempt)
            frames = [w.ident, P.TAG, P.REQUEST, key[0], key[1].encode(), stamp.pack(), p.payload]
            if not self._send_back(frames):
                self._worker_dead(w, "send failed")
                self.queue.appendleft(key)
                continue
            p.worker = w.ident
            w.inflight.add(key)
            self.stats["dispatched"] += 1
            if self.observe_queue_wait is not None:
                self.observe_queue_wait((now - p.enqueued_ns) / 1e9)

    def _pick_worker(self) -> WorkerState | None:
        """The live worker with most free credit (ties: highest ident, so the choice is stable)."""
        best: WorkerState | None = None
        best_free = 0
        for w in self.workers.values():
            free = w.free
            if free > best_free or (free == best_free and free > 0 and best is not None and w.ident > best.ident):
                best, best_free = w, free
        return best

    # ------------------------------------------------------------------------------- backend

    def _on_backend(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != P.TAG:
            self.stats["backend_malformed"] += 1
            return
        ident, cmd = frames[0], frames[2]
        w = self.workers.get(ident)
        if w is not None:
            w.expiry_ns = time.monotonic_ns() + self.hb_ns * self.liveness
        if cmd in (P.REPLY, P.ERROR) and len(frames) == 6:
            self._on_reply(ident, cmd, frames[3], frames[4], frames[5])
        elif cmd == P.HEARTBEAT:
            # Heartbeats carry the READY info too, so a restarted broker relearns its workers
            # within one interval even if it missed their READY.
            if len(frames) == 4:
                self._on_ready(ident, w, frames[3], from_heartbeat=True)
        elif cmd == P.READY and len(frames) == 4:
            self._on_ready(ident, w, frames[3], from_heartbeat=False)
        elif cmd == P.DISCONNECT and w is not None:
            w.draining = True
            log.info("worker %s draining (%d in flight)", w.worker_id, len(w.inflight))
            if not w.inflight:
                del self.workers[ident]
        else:
            self.stats["backend_malformed"] += 1

    def _on_ready(self, ident: bytes, w: WorkerState | None, data: bytes, *, from_heartbeat: bool) -> None:
        try:
            info = P.Info.unpack(data)
        except ValueError as exc:
            self.stats["backend_malformed"] += 1
            log.debug("malformed worker info: %s", exc)
            return
        if w is None:
            if from_heartbeat and info.draining:
                return
            w = self.workers[ident] = WorkerState(ident, info.worker_id, info.capacity,
                                                  time.monotonic_ns() + self.hb_ns * self.liveness)
            log.info("worker %s ready (capacity %d)", info.worker_id, info.capacity)
            self.stats["workers_joined"] += 1
        elif not from_heartbeat:
            # READY from a known worker means it reconnected: whatever it held was sent on the old
            # connection, and a reply queued there is gone with it. Re-dispatch rather than wait.
            w.capacity, w.draining = info.capacity, False
            if w.inflight:
                log.warning("worker %s reconnected with %d request(s) in flight; re-dispatching them",
                            w.worker_id, len(w.inflight))
                self.stats["worker_reconnects"] += 1
                self._recover(w, "reconnected")
        w.stats = info.stats

    def _on_reply(self, ident: bytes, cmd: bytes, client: bytes, rid: bytes, payload: bytes) -> None:
        key = (client, rid.decode(errors="replace"))
        p = self.pending.get(key)
        w = self.workers.get(ident)
        if w is not None:
            w.inflight.discard(key)
            if w.draining and not w.inflight:
                del self.workers[ident]
        if p is None or p.worker != ident:
            self.stats["late_or_unknown_reply"] += 1  # re-dispatched elsewhere, or already answered
            return
        del self.pending[key]
        if p.answered:
            self.stats["late_reply_after_deadline"] += 1
            return
        if time.monotonic_ns() >= p.deadline_ns:
            self.stats["late_reply_after_deadline"] += 1
            self._reply_error(client, key[1], DeadlineExceeded("worker replied after the deadline"))
            return
        self.stats["replies" if cmd == P.REPLY else "worker_errors"] += 1
        self._send_front([client, P.TAG, cmd, rid, payload])

    def _on_monitor(self) -> None:
        try:
            while True:
                ev = recv_monitor_message(self.back_monitor, zmq.NOBLOCK)
                log.debug("backend event %s", ev)
                if ev["event"] == zmq.EVENT_DISCONNECTED:
                    self.stats["backend_disconnects"] += 1
                    self._probe_workers()
        except zmq.Again:
            return

    def _probe_workers(self) -> None:
        """After a disconnect event, find which worker vanished (its send fails EHOSTUNREACH)."""
        for w in list(self.workers.values()):
            if not self._send_back([w.ident, P.TAG, P.HEARTBEAT]):
                self._worker_dead(w, "its connection closed: the process exited or was killed, the network "
                                     "dropped, or it sent a message over ZMQ_MAXMSGSIZE")

    # --------------------------------------------------------------------------- timers

    def _heartbeat(self, now: int) -> None:
        for w in list(self.workers.values()):
            if now > w.expiry_ns:
                silent_ms = (now - w.expiry_ns + self.hb_ns * self.liveness) // 1_000_000
                self._worker_dead(w, f"silent for {silent_ms} ms ({self.liveness} heartbeat intervals): "
                                     "hung, stopped or unreachable")
        if now >= self.next_hb_ns:
            self.next_hb_ns = now + self.hb_ns
            for w in list(self.workers.values()):
                if not self._send_back([w.ident, P.TAG, P.HEARTBEAT]):
                    self._worker_dead(w, "heartbeat send failed")
        self.next_check_ns = min(now + self.hb_ns // 10, self.next_hb_ns)

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
                self._answer_error(key, DeadlineExceeded(
                    f"deadline passed after {(now - p.enqueued_ns) / 1e6:.2f} ms waiting in the broker queue"))
            else:  # the worker still holds it: answer now, keep the record until the worker frees credit
                self.stats["expired_in_worker"] += 1
                p.answered = True
                self._reply_error(key[0], key[1], DeadlineExceeded("deadline passed while a worker was assembling"))
                # Keep the record (it holds the worker's credit) until the late reply comes, but not
                # for ever: a reply lost on the way must not leave pending/inflight stuck.
                heapq.heappush(self.timers, (now + self.hb_ns * self.liveness, p.attempt, key))

    def _reap(self, p: Pending) -> None:
        del self.pending[p.key]
        w = self.workers.get(p.worker) if p.worker is not None else None
        if w is not None:
            w.inflight.discard(p.key)
        self.stats["reaped_no_reply"] += 1
        log.warning("no reply from worker %s for request %s within %d ms of its deadline; freeing its credit",
                    w.worker_id if w else "?", p.key[1], self.hb_ns * self.liveness // 1_000_000)

    def _worker_dead(self, w: WorkerState, why: str) -> None:
        if self.workers.pop(w.ident, None) is None:
            return
        self.stats["workers_lost"] += 1
        log.warning("worker %s lost (%s); %d request(s) in flight", w.worker_id, why, len(w.inflight))
        self._recover(w, why)

    def _recover(self, w: WorkerState, why: str) -> None:
        """Requests held by a lost (or reconnected) worker: re-dispatch while time allows, else
        UNAVAILABLE; records already answered are dropped. Either way the worker holds none."""
        now = time.monotonic_ns()
        held, w.inflight = w.inflight, set()
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
                self.queue.appendleft(key)
                self.stats["redispatched"] += 1
            else:
                self._answer_error(key, Unavailable(
                    f"worker {w.worker_id} was lost ({why}) with no time left to retry"))

    # ----------------------------------------------------------------------------- replies

    def _answer_error(self, key: Key, exc: IbexError) -> None:
        self.pending.pop(key, None)
        self._reply_error(key[0], key[1], exc)

    def _reply_error(self, client: bytes, rid: str | None, err: IbexError | ErrorReply) -> None:
        self._send_front([client, P.TAG, P.ERROR, (rid or "").encode(), encode_error(err, rid)])

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

    def snapshot(self) -> dict[str, object]:
        """Counters and gauges for STATUS requests, metrics and tests."""
        return {
            "pid": os.getpid(),
            "queue_depth": len(self.queue),
            "pending": len(self.pending),
            "workers": {w.worker_id: {"capacity": w.capacity, "inflight": len(w.inflight),
                                      "draining": w.draining, "stats": w.stats}
                        for w in self.workers.values()},
            "stats": dict(self.stats),
        }
