"""The broker's backend side: worker messages, liveness, and what happens to a lost worker's work.

Liveness follows the zguide's Paranoid Pirate (heartbeats both ways, ``liveness`` silent intervals
and the worker is dead); a backend disconnect event triggers an immediate probe (ROUTER_MANDATORY
makes a send to a vanished peer fail). Requests held by a dead worker are re-dispatched while
their deadline allows, else answered UNAVAILABLE (docs/architecture.md "Processes and data flow").
"""

from __future__ import annotations

import heapq
import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ibex_context.broker.admission import Limiter, ServiceTime
from ibex_context.broker.state import MIN_RETRY_NS, BrokerBase, Pending, WorkerState
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)


class WorkerTable(BrokerBase):
    back_monitor: zmq.Socket[bytes]
    service: ServiceTime
    next_hb_ns: int
    next_check_ns: int

    def _on_backend(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != P.TAG:
            self.stats["backend_malformed"] += 1
            return
        ident = frames[0]
        w = self.workers.get(ident)
        if w is not None:
            w.expiry_ns = time.monotonic_ns() + self.hb_ns * self.liveness
        try:
            msg = P.parse_worker_message(frames[1:])
        except P.FrameError as exc:
            self.stats["backend_malformed"] += 1
            log.debug("malformed worker message: %s", exc)
            return
        if isinstance(msg, P.WorkerReply):
            self._on_reply(ident, msg)
        elif isinstance(msg, P.WorkerHeartbeat):
            # Heartbeats carry the READY info too, so a restarted broker relearns its workers
            # within one interval even if it missed their READY.
            if msg.info is not None:
                self._on_ready(ident, w, msg.info, from_heartbeat=True)
        elif isinstance(msg, P.WorkerReady):
            self._on_ready(ident, w, msg.info, from_heartbeat=False)
        else:  # DISCONNECT: take it off dispatch, then tell it so (it waits for this to drain)
            if w is not None:
                w.draining = True
                log.info("worker %s draining (%d in flight)", w.worker_id, len(w.inflight))
                if not w.inflight:
                    del self.workers[ident]
            self._send_back([ident, *P.disconnect_frames()])

    def _on_ready(self, ident: bytes, w: WorkerState | None, info: P.Info, *, from_heartbeat: bool) -> None:
        if w is None:
            if from_heartbeat and info.draining:
                return
            limiter = Limiter(info.capacity) if self.settings.adaptive_limit else None
            w = self.workers[ident] = WorkerState(ident, info.worker_id, info.capacity,
                                                  time.monotonic_ns() + self.hb_ns * self.liveness, limiter=limiter)
            log.info("worker %s ready (capacity %d)", info.worker_id, info.capacity)
            self.stats["workers_joined"] += 1
        elif not from_heartbeat:
            # READY from a known worker means it reconnected: whatever it held was sent on the old
            # connection, and a reply queued there is gone with it. Re-dispatch rather than wait.
            w.capacity, w.draining = info.capacity, False
            if w.limiter is not None:
                w.limiter.set_cap(info.capacity)
            if w.inflight:
                log.warning("worker %s reconnected with %d request(s) in flight; re-dispatching them",
                            w.worker_id, len(w.inflight))
                self.stats["worker_reconnects"] += 1
                self._recover(w, "reconnected")
        w.stats = info.stats

    def _on_reply(self, ident: bytes, reply: P.WorkerReply) -> None:
        client, correlation_id = reply.client, reply.request_id
        key = (client, correlation_id)
        p = self.pending.get(key)
        w = self.workers.get(ident)
        if w is not None:
            if p is not None and p.worker == ident:
                self._learn(w, p, reply.feedback)
            w.inflight.discard(key)
            if not w.inflight:
                w.gate_full = False  # its gate holds nothing of ours: a flag from a past burst says nothing now
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
            self._reply_error(client, correlation_id, DeadlineExceeded("worker replied after the deadline"),
                              p.request_id)
            return
        self.stats["replies" if reply.cmd == P.REPLY else "worker_errors"] += 1
        self._send_front([client, *P.reply_frames(reply.cmd, correlation_id, reply.payload)])

    def _learn(self, w: WorkerState, p: Pending, feedback: P.Feedback | None) -> None:
        """Admission control's inputs from one reply: its service time, and the worker's signals.
        Only a reply its worker served in full times the service: one degraded for lack of room
        (refused at the memory gate in a millisecond, or cut at a branch's limit) would make the
        queue look faster or slower than the answers it is meant to admit."""
        now = time.monotonic_ns()
        if feedback is None or not feedback.overloaded:
            self.service.observe(now - p.dispatched_ns)
        if feedback is not None:
            w.gate_full = feedback.gate_full
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
                    self._probe_workers()
        except zmq.Again:
            return

    def _probe_workers(self) -> None:
        """After a disconnect event, find which worker vanished (its send fails EHOSTUNREACH)."""
        for w in list(self.workers.values()):
            if not self._send_back([w.ident, *P.heartbeat_frames()]):
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
                if not self._send_back([w.ident, *P.heartbeat_frames()]):
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
                self.queue.remove(p.org, key)
                self._left_queue(p.org)
                self._answer_error(key, DeadlineExceeded(
                    f"deadline passed after {(now - p.enqueued_ns) / 1e6:.2f} ms waiting in the broker queue"))
            else:  # the worker still holds it: answer now, keep the record until the worker frees credit
                self.stats["expired_in_worker"] += 1
                p.answered = True
                self._reply_error(key[0], key[1], DeadlineExceeded("deadline passed while a worker was assembling"),
                                  p.request_id)
                # Keep the record (it holds the worker's credit) until the late reply comes, but not
                # for ever: a reply lost on the way must not leave pending/inflight stuck.
                heapq.heappush(self.timers, (now + self.hb_ns * self.liveness, p.attempt, key))

    def _reap(self, p: Pending) -> None:
        del self.pending[p.key]
        w = self.workers.get(p.worker) if p.worker is not None else None
        if w is not None:
            w.inflight.discard(p.key)
        if w is not None and not w.inflight:
            w.gate_full = False
        self.stats["reaped_no_reply"] += 1
        log.warning("no reply from worker %s for request %s within %d ms of its deadline; freeing its credit",
                    w.worker_id if w else "?", p.request_id, self.hb_ns * self.liveness // 1_000_000)

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
