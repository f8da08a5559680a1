"""The broker's worker table: which workers are live, how many requests each may hold, and when
one is lost.

Liveness follows the zguide's Paranoid Pirate (heartbeats both ways, ``liveness`` silent intervals
and the worker is dead); a backend disconnect event triggers an immediate probe (ROUTER_MANDATORY
makes a send to a vanished peer fail). The table knows workers, not requests: a lost or
reconnected worker is handed back to the broker, which re-dispatches what it held while the
deadlines allow (docs/architecture.md "Processes and data flow").
"""

from __future__ import annotations

import collections
import logging
import time

from ..shared.config.settings import BrokerSettings
from ..shared.wire import protocol as P
from .admission import Limiter
from .state import Key, Wire, WorkerState

log = logging.getLogger(__name__)

Lost = tuple[WorkerState, str]  # a worker taken off the table, and why


class WorkerTable:
    """The live workers by routing id, their free slots under the adaptive limit, and the heartbeats."""

    def __init__(self, settings: BrokerSettings, wire: Wire, stats: collections.Counter[str]) -> None:
        self.settings, self.wire, self.stats = settings, wire, stats
        self.workers: dict[bytes, WorkerState] = {}
        self.hb_ns = settings.heartbeat_interval_ms * 1_000_000
        self.liveness = settings.heartbeat_liveness
        self.next_hb_ns = time.monotonic_ns() + self.hb_ns
        self.next_check_ns = 0  # next liveness check (a tenth of an interval apart, not every poll)
        self.picks = 0  # dispatch sequence number (ties between workers go to the least recent)

    @property
    def grace_ns(self) -> int:
        """How long a silent worker is still believed alive, and a late reply still waited for."""
        return self.hb_ns * self.liveness

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, ident: bytes) -> WorkerState | None:
        return self.workers.get(ident)

    def live(self) -> list[WorkerState]:
        """Workers taking new work (not draining)."""
        return [w for w in self.workers.values() if not w.draining]

    def heard(self, ident: bytes) -> WorkerState | None:
        """A message came from ``ident``: it is alive for another ``grace_ns``."""
        w = self.workers.get(ident)
        if w is not None:
            w.expiry_ns = time.monotonic_ns() + self.grace_ns
        return w

    def on_ready(self, ident: bytes, w: WorkerState | None, info: P.Info, *,
                 from_heartbeat: bool) -> WorkerState | None:
        """READY (or a heartbeat carrying its info, so a restarted broker relearns its workers within
        one interval). Returns the worker when it reconnected holding requests: whatever it held was
        sent on the old connection, and a reply queued there is gone with it; the broker re-dispatches."""
        reconnected = None
        if w is None:
            if from_heartbeat and info.draining:
                return None
            limiter = Limiter(info.capacity) if self.settings.adaptive_limit else None
            w = self.workers[ident] = WorkerState(ident, info.worker_id, info.capacity,
                                                  time.monotonic_ns() + self.grace_ns, limiter=limiter)
            log.info("worker %s ready (capacity %d)", info.worker_id, info.capacity)
            self.stats["workers_joined"] += 1
        elif not from_heartbeat:
            w.capacity, w.draining = info.capacity, False
            if w.limiter is not None:
                w.limiter.set_cap(info.capacity)
            if w.inflight:
                log.warning("worker %s reconnected with %d request(s) in flight; re-dispatching them",
                            w.worker_id, len(w.inflight))
                self.stats["worker_reconnects"] += 1
                reconnected = w
        w.stats = info.stats
        return reconnected

    def on_disconnect(self, ident: bytes, w: WorkerState | None) -> None:
        """DISCONNECT: take it off dispatch, then tell it so (it waits for this to drain)."""
        if w is not None:
            w.draining = True
            log.info("worker %s draining (%d in flight)", w.worker_id, len(w.inflight))
            if not w.inflight:
                del self.workers[ident]
        self.wire.send_back([ident, *P.disconnect_frames()])

    def release(self, w: WorkerState, key: Key) -> None:
        """``w`` holds ``key`` no more; a draining worker holding nothing leaves the table."""
        w.inflight.discard(key)
        if not w.inflight:
            w.gate_full = False  # its gate holds nothing of ours: a flag from a past burst says nothing now
        if w.draining and not w.inflight:
            self.workers.pop(w.ident, None)

    def pick(self) -> WorkerState | None:
        """The live worker with most free slots; ties go to the one dispatched to least recently, so
        equal workers get equal work (a stable tie-break would load one worker 2-3x more)."""
        best: WorkerState | None = None
        best_free = 0
        for w in self.workers.values():
            free = w.free
            if free > best_free or (free == best_free and free > 0 and best is not None and w.picked < best.picked):
                best, best_free = w, free
        return best

    def dispatched(self, w: WorkerState, key: Key) -> None:
        self.picks += 1
        w.picked = self.picks
        w.inflight.add(key)

    def remove(self, w: WorkerState) -> bool:
        """Take a lost worker off the table; False if it was gone already."""
        if self.workers.pop(w.ident, None) is None:
            return False
        self.stats["workers_lost"] += 1
        return True

    def probe(self) -> list[Lost]:
        """After a disconnect event, find which worker vanished (its send fails EHOSTUNREACH)."""
        return [(w, "its connection closed: the process exited or was killed, the network dropped, or it "
                    "sent a message over ZMQ_MAXMSGSIZE")
                for w in list(self.workers.values()) if not self.wire.send_back([w.ident, *P.heartbeat_frames()])]

    def heartbeat(self, now: int) -> list[Lost]:
        """Workers silent past their liveness are lost; every interval each live one is sent a heartbeat
        (a failed send: lost too)."""
        lost: list[Lost] = []
        for w in list(self.workers.values()):
            if now > w.expiry_ns:
                silent_ms = (now - w.expiry_ns + self.grace_ns) // 1_000_000
                lost.append((w, f"silent for {silent_ms} ms ({self.liveness} heartbeat intervals): "
                                "hung, stopped or unreachable"))
        gone = {w.ident for w, _ in lost}
        if now >= self.next_hb_ns:
            self.next_hb_ns = now + self.hb_ns
            lost += [(w, "heartbeat send failed") for w in list(self.workers.values())
                     if w.ident not in gone and not self.wire.send_back([w.ident, *P.heartbeat_frames()])]
        self.next_check_ns = min(now + self.hb_ns // 10, self.next_hb_ns)
        return lost

    def snapshot(self) -> dict[str, object]:
        return {w.worker_id: {"capacity": w.capacity, "limit": w.slots, "inflight": len(w.inflight),
                              "draining": w.draining, "stats": w.stats}
                for w in self.workers.values()}
