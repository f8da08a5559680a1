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
and it embeds R a second, one at a time in order of arrival; a call that would not be done
within a retrieval wall is refused at once and the reply is degraded (``degraded``, feedback:
refused for lack of capacity), which is what the broker's dispatch rate learns from. The
machine's CPU load then plays no part in who is served: the run shows the broker's admission
alone. The emulated service serves calls first come, first served (the real one serves orgs
by fair share), so here a victim's call can be refused behind the flood's.

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
from pathlib import Path

import msgpack
import zmq

from bench.lib.checkout import pythonpath
from bench.lib.stack import REPO
from bench.lib.tables import table
from ibex_context.ops.stack import free_port, stop_processes
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.protocol import Envelope, pack_header

WARMUP_S = 1.0
RATE_EVERY_S = 0.5  # the broker's dispatch rate is read this often


class MemoryService:
    """A memory service that embeds one call at a time in ``1 / rps`` seconds, its calls queued in
    order of arrival, and refuses a call at once when it would not be done within ``WALL_S`` (as
    the real one's search slots refuse a call that would end past its deadline); 0: none (no call
    is made, and the feedback says so)."""

    WALL_S = 0.045  # a worker's retrieval wall at a 100 ms deadline

    def __init__(self, rps: float) -> None:
        self.rps = rps
        self.free_at = 0.0

    def call(self, now: float) -> float | None:
        """How long a call made now takes (None: refused for lack of capacity)."""
        if self.rps <= 0:
            return 0.0
        done = max(now, self.free_at) + 1.0 / self.rps
        if done - now > self.WALL_S:
            return None
        self.free_at = done
        return done - now


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
        while due and due[0][0] <= now:
            s.send_multipart(heapq.heappop(due)[2])
        if now - last_hb > 0.2:
            s.send_multipart(P.heartbeat_frames(info))
            last_hb = now
        wait_ms = max(0, int((due[0][0] - now) * 1000)) if due else 50
        if not s.poll(min(wait_ms, 50)):
            continue
        msg = P.parse_broker_message(s.recv_multipart())
        if isinstance(msg, P.Dispatch):
            now = time.monotonic()
            took = memory.call(now)
            served = took is not None
            feedback = P.Feedback(not served, 0, False, asks, not served)
            reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, b"ok" if served else b"degraded",
                                          feedback)
            seq += 1
            heapq.heappush(due, (now + (max(service_s, took) if took is not None else 0.001), seq, reply))
    s.close(linger=0)


def run(args: argparse.Namespace) -> dict[str, collections.Counter[str]]:
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
    ops = ctx.socket(zmq.DEALER)
    ops.setsockopt(zmq.LINGER, 0)
    ops.connect(fe)
    rates: list[str] = []  # the broker's dispatch rate, every RATE_EVERY_S
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
                        rate = status.snapshot.get("dispatch_rate")
                        rates.append("-" if rate is None else f"{rate:g}")
                    continue
                while s.poll(0):
                    reply = P.parse_reply(s.recv_multipart())
                    if not isinstance(reply, P.Reply) or reply.correlation_id not in sent:
                        continue
                    if reply.is_error:
                        outcome[reply.correlation_id] = str(msgpack.unpackb(reply.payload).get("code", "?"))
                    elif time.monotonic() > sent[reply.correlation_id][2]:
                        outcome[reply.correlation_id] = "late"
                    else:
                        outcome[reply.correlation_id] = "ok" if reply.payload == b"ok" else "degraded"
        result = {org: collections.Counter[str]() for org in orgs}
        for rid, (org, at, _) in sent.items():
            if at >= t0 + WARMUP_S:
                result[org][outcome.get(rid, "no reply")] += 1
        socks["victim"].send_multipart(P.status_request_frames())
        if socks["victim"].poll(5000):
            status = P.parse_reply(socks["victim"].recv_multipart())
            if isinstance(status, P.StatusReply):
                stats = status.snapshot.get("stats", {})
                result["broker (whole run)"] = collections.Counter(
                    {k: v for k, v in stats.items() if k.startswith(("expired", "shed", "pushed", "rejected"))})
        result["dispatch rate"] = collections.Counter({" ".join(rates): 1})
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
    broker = result.pop("broker (whole run)", collections.Counter())
    rates = next(iter(result.pop("dispatch rate", collections.Counter({"": 1}))))
    kinds = sorted({k for c in result.values() for k in c} - {"ok"})
    rows = [[org, str(sum(c.values())), f"{100 * c['ok'] / max(1, sum(c.values())):.1f} %",
             *(str(c[k]) for k in kinds)] for org, c in result.items()]
    served = args.capacity / args.service_ms * 1e3
    memory = f", its memory service {args.memory_rps:g}/s" if args.memory_rps > 0 else ""
    print(f"broker from {args.tree}; worker serves {served:.0f}/s{memory}; after the first {WARMUP_S:.0f} s:\n")
    print("\n".join(table(["org", "sent", "ok on time", *kinds], rows)))
    print("\nbroker counters, whole run: " + (", ".join(f"{k} {v}" for k, v in sorted(broker.items())) or "none"))
    print(f"dispatch rate every {RATE_EVERY_S:g} s (- unlimited): {rates or 'not read'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
