"""The transport floor (docs/performance.md): bare pyzmq, no application code, measured in the same run.

Absolute times on these shared machines drift from run to run, so the broker's overhead is judged
against a floor measured minutes apart on the same box:

* relay: client DEALER -> ``zmq.proxy`` (ROUTER/DEALER, C code) in its own process -> an echo
  process (ROUTER that sends every message straight back). Driven open-loop at the same offered
  rate as the transport-mode run, by the same generator, and also closed-loop (one in flight).
* ping-pong: client DEALER <-> the echo process directly, closed-loop (two processes, one hop).

Child processes: ``python -m bench.floor relay FRONT BACK``, ``python -m bench.floor echo
[--bind EP] [--connect EP]`` and ``python -m bench.floor answer BACK`` (replies in the protocol, for
``bench.peers``); all run until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from bench.lib.stack import spawn_module
from bench.loadgen import OK, Reply, RunResult, open_loop
from bench.stats import Histograms
from ibex_context.ops.stack import free_port, stop_processes
from ibex_context.shared.wire.loopsock import LoopSocket

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ child processes


def serve_relay(front: str, back: str) -> None:
    ctx = zmq.Context()
    fe, be = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (fe, be):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
    fe.bind(front)
    be.bind(back)
    zmq.proxy(fe, be)  # returns only when the context terminates; SIGTERM ends the process


def serve_echo(bind: str | None, connect: str | None) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    if bind:
        s.bind(bind)
    if connect:
        s.connect(connect)
    while True:
        s.send_multipart(s.recv_multipart(copy=False), copy=False)


def serve_answer(connect: str) -> None:
    """Behind the relay: answer every request as transport-mode workers do (the canned minimal
    reply for its request id), so the client library can drive the floor (``bench.peers``' zmq-floor:
    the CPU and latency of the card's two hops with no Python broker at all)."""
    from bench.lib.transport import transport_response
    from ibex_context.shared.wire import protocol as P
    from ibex_context.shared.wire.codec import encode_document
    from ibex_context.shared.wire.protocol import Envelope, parse_header

    template = transport_response("-", {}).model_dump(mode="python")
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(connect)
    while True:
        # [relay id, client id, IBX2, REQUEST, header, payload] or [..., CORRELATED, id, header, payload]
        frames = s.recv_multipart()
        if len(frames) == 6 and frames[3] == P.REQUEST:
            env, cid = parse_header(frames[4]), None
        elif len(frames) == 7 and frames[3] == P.CORRELATED:
            env, cid = parse_header(frames[5]), frames[4]
        else:
            continue
        if not isinstance(env, Envelope):
            continue
        rid = env.request_id
        body = encode_document({**template, "request_id": rid, "timings_us": {}}, rid)
        s.send_multipart([frames[0], frames[1], *P.reply_frames(P.REPLY, cid or rid.encode(), body)])


@dataclass
class FloorProcs:
    relay_front: str
    direct: str
    procs: list[subprocess.Popen[bytes]]


@contextlib.contextmanager
def floor_processes() -> Iterator[FloorProcs]:
    """Start the relay and the echo process on free loopback ports; stop and reap them after."""
    front, back, direct = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for args in (["relay", front, back], ["echo", "--bind", direct, "--connect", back]):
            procs.append(spawn_module("bench.floor", args))
        fp = FloorProcs(front, direct, procs)
        _wait_echo(fp.relay_front)
        _wait_echo(fp.direct)
        yield fp
    finally:
        stop_processes(procs, timeout_s=5)


def _wait_echo(endpoint: str, timeout_s: float = 15.0) -> None:
    """Block until a message sent to ``endpoint`` comes back (children take a moment to import)."""
    end = time.monotonic() + timeout_s
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        while time.monotonic() < end:
            s.send_multipart([b"probe", b""])
            if s.poll(200):
                s.recv_multipart()
                while s.poll(50):  # earlier probes that came back late
                    s.recv_multipart()
                return
        raise RuntimeError(f"floor echo via {endpoint} did not answer within {timeout_s:.0f}s")


# ---------------------------------------------------------------------------------- measurements


def pingpong(endpoint: str, n: int, payload: bytes, *, warmup: int = 50) -> Histograms:
    """Closed-loop round trips (one in flight), blocking sockets, µs into the ``rtt`` histogram."""
    hs = Histograms()
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            s.send_multipart([b"p", payload])
            s.recv_multipart()
            if i >= warmup:
                hs.record("rtt", (time.perf_counter_ns() - t0) / 1000)
    return hs


class RawTarget:
    """An open-loop target over a bare DEALER: [id, payload] out, the same back.

    Served the way the client library serves its sockets (``shared.wire.loopsock``), so the floor's
    generator side costs no more than the client's and the comparison is about what lies between.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, payload: bytes) -> None:
        self.raw = ctx.socket(zmq.DEALER)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw.setsockopt(zmq.SNDHWM, 100_000)
        self.raw.setsockopt(zmq.RCVHWM, 100_000)
        self.raw.connect(endpoint)
        self.payload = payload
        self.waiting: dict[bytes, asyncio.Future[None]] = {}
        self.sock: LoopSocket | None = None

    def _on_frames(self, frames: list[bytes]) -> None:
        fut = self.waiting.pop(frames[0], None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def __call__(self, i: int, timeout_s: float) -> Reply:
        if self.sock is None:
            self.sock = LoopSocket(self.raw, self._on_frames, name="floor")
        rid = str(i).encode()
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        err = self.sock.send([rid, self.payload])  # no IMMEDIATE: queued until connected
        if err is not None:
            self.waiting.pop(rid, None)
            return Reply(f"SEND_FAILED:{err.errno}")
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            self.waiting.pop(rid, None)
            return Reply("TIMEOUT")
        return Reply(OK)

    async def aclose(self) -> None:
        if self.sock is not None:
            self.sock.close()
        else:
            self.raw.close(linger=0)


async def relay_open_loop(endpoint: str, *, rate: float, duration_s: float, payload: bytes,
                          seed: int = 3, tick: Callable[[int], None] | None = None) -> RunResult:
    """The open-loop generator against the bare relay, at the transport run's offered rate."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    target = RawTarget(ctx, endpoint, payload)
    try:
        await target(-1, 5.0)  # connect and warm the path before the clock starts
        return await open_loop(target, rate=rate, duration_s=duration_s, deadline_ms=None, label="floor relay",
                               seed=seed, tick=tick, meta={"mode": "floor-relay"})
    finally:
        await target.aclose()
        ctx.term()


def measure(*, rate: float, duration_s: float, pingpongs: int, payload: bytes,
            tick: Callable[[int], None] | None = None,
            run: Callable[[Coroutine[Any, Any, RunResult]], RunResult] = asyncio.run) -> dict[str, Any]:
    """Run every floor measurement and return their summaries (µs).

    ``run`` executes the open-loop coroutine; the bench passes its uvloop runner so the floor and
    the transport run use the same kind of event loop.
    """
    with floor_processes() as fp:
        relay_rtt = pingpong(fp.relay_front, pingpongs, payload)
        direct_rtt = pingpong(fp.direct, pingpongs, payload)
        result = run(relay_open_loop(fp.relay_front, rate=rate, duration_s=duration_s, payload=payload, tick=tick))
    return {
        "payload_bytes": len(payload),
        "relay_open_loop": result.summary(),
        "relay_pingpong_us": relay_rtt.summary()["rtt"],
        "pingpong_us": direct_rtt.summary()["rtt"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("relay")
    r.add_argument("front")
    r.add_argument("back")
    e = sub.add_parser("echo")
    e.add_argument("--bind")
    e.add_argument("--connect")
    a = sub.add_parser("answer")
    a.add_argument("connect")
    args = ap.parse_args(argv)
    if args.cmd == "relay":
        serve_relay(args.front, args.back)
    elif args.cmd == "answer":
        serve_answer(args.connect)
    else:
        serve_echo(args.bind, args.connect)
    return 0


if __name__ == "__main__":
    sys.exit(main())
