"""``python -m bench.fairshare``: one org's goodput at the broker while another org floods it.

The real broker (``python -m ibex_context.broker``, from this checkout or ``--tree``) in front of a
scripted worker thread (``--capacity`` requests at once, each answered after ``--service-ms``, so
it serves capacity / service a second). Two orgs send open-loop from this process: the victim at
``--victim-rate`` a second with a ``--victim-deadline-ms`` deadline, the attacker at
``--attacker-rate`` with ``--attacker-deadline-ms``. Each request ends as ``ok`` (a reply before
its deadline), ``late`` (a reply after it), ``OVERLOADED``, ``DEADLINE_EXCEEDED``, another error
code, or ``no reply``. The first second is left out (the broker learns the service time).

``--memory-rps R`` puts a memory service of fixed throughput behind the worker, as the real one
is for assemblies that ask a new question: each request asks it (the reply's feedback says so)
and it embeds R a second, one at a time, orgs in turn (``MemoryService``); a call that would not
be done within a retrieval wall is refused at once and the reply is degraded (``degraded``,
feedback: refused for lack of capacity), which is what the broker's dispatch rate learns from.
The machine's CPU load then plays no part in who is served: the run shows the broker's admission
alone.

``--tree PATH`` runs the broker of another checkout (e.g. ``git archive <commit> | tar -x -C
PATH``) with the same clients and worker, to compare two versions on one machine in one sitting.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.lib.checkout import pythonpath
from bench.lib.percentiles import percentile
from bench.lib.stack import REPO
from bench.lib.tables import table
from ibex_context.ops.stack import free_port, stop_processes
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.protocol import Envelope, pack_header

WARMUP_S = 1.0
RATE_EVERY_S = 0.5  # the broker's dispatch rate is read this often


class MemoryService:
    """A memory service that embeds one call at a time in ``1 / rps`` seconds and serves orgs by
    fair share, as the real one's search slots do: orgs with calls waiting take turns (round
    robin), and an org that had none waiting goes next (its first call is not queued behind a
    flood's, as the real service gives a freed slot to the org with the fewest in). A call that would not be done within
    ``WALL_S`` (its place in that order counted) is refused at once, as the real service refuses a
    call that would end past its deadline. ``rps`` 0: none (no call is made; the feedback says so).
    Pure bookkeeping on the clock the caller passes."""

    WALL_S = 0.045  # a worker's retrieval wall at a 100 ms deadline

    def __init__(self, rps: float) -> None:
        self.rps = rps
        self.busy_until = 0.0
        self.waiting: dict[str, collections.deque[Any]] = {}  # org -> its calls' tokens, oldest first
        self.turns: collections.deque[str] = collections.deque()  # orgs with calls waiting, next first
        self.current: Any = None  # the call being embedded, done at busy_until

    def ahead(self, org: str) -> int:
        """Calls that would be served before a new one of ``org``: its own waiting ones, and as
        many of each other waiting org's (round robin; none for an org with none waiting)."""
        mine = len(self.waiting.get(org, ()))
        return mine + sum(min(len(q), mine) for o, q in self.waiting.items() if o != org)

    def call(self, org: str, token: Any, now: float) -> bool:
        """Queue a call (``token`` comes back from ``done`` when it is served); False: refused."""
        if self.rps <= 0:
            return True
        start = max(now, self.busy_until)  # when the call being embedded now is done
        if start + (self.ahead(org) + 1) / self.rps - now > self.WALL_S:
            return False
        if org not in self.waiting:
            self.waiting[org] = collections.deque()
            self.turns.appendleft(org)
        self.waiting[org].append(token)
        if self.current is None:
            self._start(max(now, self.busy_until))
        return True

    def _start(self, at: float) -> None:
        """The next call in turn starts at ``at``."""
        org = self.turns.popleft()
        q = self.waiting[org]
        self.current = q.popleft()
        self.busy_until = at + 1.0 / self.rps
        if q:
            self.turns.append(org)
        else:
            del self.waiting[org]

    def done(self, now: float) -> list[tuple[float, Any]]:
        """(finished at, token) of the calls served by ``now``, in order."""
        out: list[tuple[float, Any]] = []
        while self.current is not None and self.busy_until <= now:
            out.append((self.busy_until, self.current))
            self.current = None
            if self.turns:
                self._start(self.busy_until)
        return out

    def next_s(self) -> float | None:
        """When the call being embedded is done (monotonic s), or None when idle."""
        return self.busy_until if self.current is not None else None


def worker(ctx: zmq.Context[zmq.Socket[bytes]], backend: str, capacity: int, service_s: float,
           stop: threading.Event, memory_rps: float = 0.0) -> None:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(backend)
    info = P.Info(capacity, "scripted", os.getpid())
    s.send_multipart(P.ready_frames(info))
    due: list[tuple[float, int, list[bytes]]] = []  # (when, seq, frames), a heap
    memory = MemoryService(memory_rps)
    asks = memory_rps > 0
    seq = 0
    last_hb = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        for _, (d, msg) in memory.done(now):  # served: the reply goes a service time after its dispatch
            seq += 1
            reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, b"ok", P.Feedback(False, 0, False, True))
            heapq.heappush(due, (max(now, d + service_s), seq, reply))
        while due and due[0][0] <= now:
            s.send_multipart(heapq.heappop(due)[2])
        if now - last_hb > 0.2:
            s.send_multipart(P.heartbeat_frames(info))
            last_hb = now
        wake = min(due[0][0] if due else now + 0.05, memory.next_s() or now + 0.05)
        if not s.poll(min(50, max(0, int((wake - now) * 1000)))):
            continue
        msg = P.parse_broker_message(s.recv_multipart())
        if not isinstance(msg, P.Dispatch):
            continue
        now = time.monotonic()
        env = P.parse_header(msg.header)
        org = env.org_id if isinstance(env, Envelope) else "?"
        if not asks:
            reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, b"ok", P.Feedback(False, 0))
        elif memory.call(org, (now, msg), now):
            continue  # answered when the memory service has served it
        else:  # refused for lack of capacity: a degraded reply at once
            reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, b"degraded",
                                          P.Feedback(True, 0, False, True, True))
        seq += 1
        heapq.heappush(due, (now + (service_s if not asks else 0.001), seq, reply))
    s.close(linger=0)


@dataclass
class Run:
    """What one run measured: per org, its outcomes and the p99 seconds to the answer of what was
    not served whole (absent when everything was); the broker's counters over the whole run; the
    dispatch rate read every ``RATE_EVERY_S`` (None: unlimited)."""

    outcomes: dict[str, collections.Counter[str]]
    not_whole_p99_s: dict[str, float] = field(default_factory=dict)
    broker: collections.Counter[str] = field(default_factory=collections.Counter)
    rates: list[float | None] = field(default_factory=list)


def run(args: argparse.Namespace) -> Run:
    fe, be = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env["PYTHONPATH"] = pythonpath(args.tree)  # that checkout's package, not the installed one
    broker = subprocess.Popen([sys.executable, "-m", "ibex_context.broker", "--frontend", fe, "--backend", be],
                              cwd=args.tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stop = threading.Event()
    thread = threading.Thread(target=worker, args=(ctx, be, args.capacity, args.service_ms / 1e3, stop,
                                                   args.memory_rps), daemon=True)
    thread.start()
    orgs = {"victim": (args.victim_rate, args.victim_deadline_ms), "attacker": (args.attacker_rate,
                                                                              args.attacker_deadline_ms)}
    socks = {org: ctx.socket(zmq.DEALER) for org in orgs}
    for s in socks.values():
        s.setsockopt(zmq.LINGER, 0)
        s.connect(fe)
    sent: dict[str, tuple[str, float, float]] = {}  # request id -> (org, sent at, deadline at), monotonic s
    outcome: dict[str, str] = {}
    took: dict[str, float] = {}  # request id -> seconds from its scheduled send to its answer
    ops = ctx.socket(zmq.DEALER)
    ops.setsockopt(zmq.LINGER, 0)
    ops.connect(fe)
    rates: list[float | None] = []  # the broker's dispatch rate, every RATE_EVERY_S
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    poller.register(ops, zmq.POLLIN)
    try:
        time.sleep(1.0)  # the broker binds and the worker joins
        t0 = time.monotonic()
        nxt = {org: t0 for org in orgs}
        count = collections.Counter[str]()
        next_status = t0
        while (now := time.monotonic()) < t0 + args.seconds + 2:
            if now >= next_status and now < t0 + args.seconds:
                ops.send_multipart(P.status_request_frames())
                next_status += RATE_EVERY_S
            for org, (rate, deadline_ms) in orgs.items():
                while now < t0 + args.seconds and nxt[org] <= now:
                    rid = f"{org}-{count[org]}"
                    count[org] += 1
                    dl = time.time_ns() + int(deadline_ms * 1e6)
                    socks[org].send_multipart(P.request_frames(pack_header(Envelope(rid, org, "bot", dl)), b"\x80"))
                    sent[rid] = (org, nxt[org], now + deadline_ms / 1e3)
                    nxt[org] += 1 / rate
            for s, _ in poller.poll(1):
                if s is ops:
                    status = P.parse_reply(ops.recv_multipart())
                    if isinstance(status, P.StatusReply):
                        rates.append(status.snapshot.get("dispatch_rate"))
                    continue
                while s.poll(0):
                    reply = P.parse_reply(s.recv_multipart())
                    if not isinstance(reply, P.Reply) or reply.correlation_id not in sent:
                        continue
                    took[reply.correlation_id] = time.monotonic() - sent[reply.correlation_id][1]
                    if reply.is_error:
                        outcome[reply.correlation_id] = str(msgpack.unpackb(reply.payload).get("code", "?"))
                    elif time.monotonic() > sent[reply.correlation_id][2]:
                        outcome[reply.correlation_id] = "late"
                    else:
                        outcome[reply.correlation_id] = "ok" if reply.payload == b"ok" else "degraded"
        result = Run({org: collections.Counter[str]() for org in orgs}, rates=rates)
        not_ok: dict[str, list[float]] = {org: [] for org in orgs}
        for rid, (org, at, _) in sent.items():
            if at >= t0 + WARMUP_S:
                result.outcomes[org][outcome.get(rid, "no reply")] += 1
                if outcome.get(rid, "ok") != "ok" and rid in took:
                    not_ok[org].append(took[rid])
        for org, times in not_ok.items():  # how long what was not served whole took to be answered
            if times:
                result.not_whole_p99_s[org] = percentile(times, 99)
        socks["victim"].send_multipart(P.status_request_frames())
        if socks["victim"].poll(5000):
            status = P.parse_reply(socks["victim"].recv_multipart())
            if isinstance(status, P.StatusReply):
                stats = status.snapshot.get("stats", {})
                result.broker = collections.Counter(
                    {k: v for k, v in stats.items() if k.startswith(("expired", "shed", "pushed", "rejected"))})
        return result
    finally:
        ops.close(linger=0)
        stop.set()
        thread.join(5)
        for s in socks.values():
            s.close(linger=0)
        ctx.term()
        stop_processes([broker], timeout_s=5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fairshare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=REPO, help="checkout whose broker runs (default: this one)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long both orgs send (default 10)")
    ap.add_argument("--capacity", type=int, default=4, help="the worker's requests at once (default 4)")
    ap.add_argument("--service-ms", type=float, default=57.0, help="each request's service time (default 57)")
    ap.add_argument("--victim-rate", type=float, default=10.0, help="victim requests a second (default 10)")
    ap.add_argument("--victim-deadline-ms", type=float, default=100.0, help="victim deadline (default 100)")
    ap.add_argument("--attacker-rate", type=float, default=320.0, help="attacker requests a second (default 320)")
    ap.add_argument("--attacker-deadline-ms", type=float, default=1000.0, help="attacker deadline (default 1000)")
    ap.add_argument("--memory-rps", type=float, default=0.0,
                    help="a memory service behind the worker that serves this many calls a second (module doc; "
                         "default 0: none)")
    args = ap.parse_args(argv)
    result = run(args)
    broker = result.broker
    rates = " ".join("-" if r is None else f"{r:g}" for r in result.rates)
    p99 = {org: f"{s * 1e3:.1f}" for org, s in result.not_whole_p99_s.items()}
    kinds = sorted({k for c in result.outcomes.values() for k in c} - {"ok"})
    rows = [[org, str(sum(c.values())), f"{100 * c['ok'] / max(1, sum(c.values())):.1f} %",
             *(str(c[k]) for k in kinds), p99.get(org, "-")] for org, c in result.outcomes.items()]
    served = args.capacity / args.service_ms * 1e3
    memory = f", its memory service {args.memory_rps:g}/s" if args.memory_rps > 0 else ""
    print(f"broker from {args.tree}; worker serves {served:.0f}/s{memory}; after the first {WARMUP_S:.0f} s:\n")
    print("\n".join(table(["org", "sent", "ok on time", *kinds, "not whole: p99 ms to the answer"], rows)))
    print("\nbroker counters, whole run: " + (", ".join(f"{k} {v}" for k, v in sorted(broker.items())) or "none"))
    print(f"dispatch rate every {RATE_EVERY_S:g} s (- unlimited): {rates or 'not read'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
