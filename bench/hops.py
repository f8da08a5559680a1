"""``python -m bench.hops``: CPU per request of each transport hop, measured in isolation.

The open-loop bench (``bench.run``) shows latency; this shows where CPU goes, which is what a change
to the broker, the worker's socket loop or the frames moves. Each row drives one real process with
a pipelined synchronous peer (window of 4 in flight) and reads the process's CPU time
(``bench.lib.cpu``: all threads, so ZeroMQ's I/O thread is included):

* ``broker``: ``python -m ibex_context.broker`` between a DEALER client and a bare echo worker;
* ``worker (transport mode)``: the transport-mode worker's server loop (``bench.lib.transport``) behind
  a bare ROUTER acting as the broker;
* ``relay (zmq.proxy, C)`` and ``echo (pyzmq, sync)``: the floor's processes, for reference.

Medians of ``--repeats`` runs; the machine is shared, so compare rows from the same invocation.

Child roles (internal): ``python -m bench.hops echo-worker ENDPOINT`` and
``python -m bench.hops transport-worker ENDPOINT``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import ClassVar

import zmq

from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median
from bench.lib.stack import spawn_module
from bench.lib.tables import table
from bench.workload import request_templates
from ibex_context.ops.stack import free_port, stop_processes
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.models import AssembleRequest, Message
from ibex_context.shared.wire.protocol import Envelope, pack_header


def template(pad_kb: int = 0) -> AssembleRequest:
    """The demo request, padded with recent messages to about ``pad_kb`` KiB more when asked
    (the broker's cost must not grow with the payload)."""
    tmpl = request_templates(seed=9)[0]
    if pad_kb <= 0:
        return tmpl
    chunk = "lorem ipsum dolor sit amet " * 300  # 8,100 characters
    n = max(1, pad_kb * 1024 // len(chunk))
    msgs = [*tmpl.recent_messages, *(Message(role="user", content=chunk) for _ in range(n))]
    return tmpl.model_copy(update={"recent_messages": msgs})


# ----------------------------------------------------------------------------------- child roles


def echo_worker(endpoint: str) -> None:
    """A worker with no application code: READY, then every request's payload straight back."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send_multipart([P.TAG, P.READY, P.Info(8, "echo", os.getpid()).pack()])
    while True:
        f = s.recv_multipart()
        if len(f) == 2 and f[1] == P.HEARTBEAT:
            s.send_multipart([P.TAG, P.HEARTBEAT, P.Info(8, "echo", os.getpid()).pack()])
        elif len(f) == 7 and f[1] == P.REQUEST:
            s.send_multipart([P.TAG, P.REPLY, f[2], f[3], f[6]])


def transport_worker(endpoint: str) -> None:
    """The real worker server in transport mode (no retrieval, so no Redis or memory service)."""
    import uvloop

    from bench.lib.transport import TransportWorkerServer
    from ibex_context.shared.config.settings import Settings

    class NoAssembler:
        stats: ClassVar[dict[str, int]] = {}
        calibrator: ClassVar[None] = None  # no usage reports in a transport measurement

    async def serve() -> None:
        server = TransportWorkerServer(settings=Settings(worker_concurrency=8), assembler=NoAssembler(),
                                       worker_id="hops", endpoints=[endpoint], ctx=zmq.Context())
        await server.run()

    uvloop.run(serve())


# ---------------------------------------------------------------------------------- measurements


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    """``python -m MODULE ARGS`` (``args``), without this process's ``IBEX_`` settings."""
    assert args[0] == "-m", args
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    return spawn_module(args[1], list(args[2:]), env=env)


def _pipelined(send: Callable[[int], None], recv: Callable[[], bool], n: int, window: int) -> float:
    """Keep ``window`` requests in flight until ``n`` are answered; returns seconds taken."""
    t0 = time.perf_counter()
    sent = done = 0
    while done < n:
        while sent < n and sent - done < window:
            send(sent)
            sent += 1
        if recv():
            done += 1
    return time.perf_counter() - t0


def measure_broker(n: int, window: int, pad_kb: int = 0) -> dict[str, float]:
    """The broker between a DEALER client and the echo worker."""
    fe, be = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    procs = [_spawn("-m", "ibex_context.broker", "--frontend", fe, "--backend", be)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    try:
        procs.append(_spawn("-m", "bench.hops", "echo-worker", be))
        c.connect(fe)
        tmpl = template(pad_kb)
        far = time.time_ns() + 3600 * 10**9
        reqs = [tmpl.model_copy(update={"request_id": f"h{i}", "deadline_ns": far}) for i in range(n)]
        frames = [P.request_frames(pack_header(Envelope(r.request_id, r.org_id, r.agent_id, far)), encode(r))
                  for r in reqs]
        end = time.monotonic() + 20
        while True:  # the worker has joined once a request comes back
            c.send_multipart(frames[0])
            if c.poll(500) and c.recv_multipart()[1] == P.REPLY:
                break
            if time.monotonic() > end:
                raise RuntimeError("broker and echo worker did not come up within 20 s")
        cpu0 = cpu_seconds(procs[0].pid)
        wall = _pipelined(lambda i: c.send_multipart(frames[i]),
                          lambda: c.recv_multipart()[1] == P.REPLY, n, window)
        return {"rps": n / wall, "cpu_us": (cpu_seconds(procs[0].pid) - cpu0) / n * 1e6}
    finally:
        c.close(linger=0)
        ctx.term()
        stop_processes(procs, timeout_s=5)


def measure_worker(n: int, window: int, pad_kb: int = 0) -> dict[str, float]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    procs = [_spawn("-m", "bench.hops", "transport-worker", f"tcp://127.0.0.1:{port}")]
    try:
        if not r.poll(20_000):
            raise RuntimeError("transport-mode worker did not connect within 20 s")
        ident = r.recv_multipart()[0]
        tmpl = template(pad_kb)
        payload = encode(tmpl)
        far = time.time_ns() + 3600 * 10**9
        header = pack_header(Envelope(tmpl.request_id, tmpl.org_id, tmpl.agent_id, far))

        def send(i: int) -> None:
            stamp = P.Stamp(far, 0, time.time_ns(), 1)
            r.send_multipart([ident, *P.dispatch_frames(b"client", f"h{i}".encode(), stamp, header, payload)])

        def recv() -> bool:
            return r.recv_multipart()[2] == P.REPLY

        _pipelined(send, recv, 200, window)  # warm up
        cpu0 = cpu_seconds(procs[0].pid)
        wall = _pipelined(send, recv, n, window)
        return {"rps": n / wall, "cpu_us": (cpu_seconds(procs[0].pid) - cpu0) / n * 1e6}
    finally:
        r.close(linger=0)
        ctx.term()
        stop_processes(procs, timeout_s=5)


def measure_floor(n: int, window: int, pad_kb: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    fe, be = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    procs = [_spawn("-m", "bench.floor", "relay", fe, be), _spawn("-m", "bench.floor", "echo", "--connect", be)]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    try:
        c.connect(fe)
        payload = encode(template(pad_kb))
        end = time.monotonic() + 20
        while True:
            c.send_multipart([b"probe", payload])
            if c.poll(500):
                c.recv_multipart()
                break
            if time.monotonic() > end:
                raise RuntimeError("floor relay did not come up within 20 s")
        while c.poll(100):
            c.recv_multipart()
        cpu0 = [cpu_seconds(p.pid) for p in procs]
        wall = _pipelined(lambda i: c.send_multipart([str(i).encode(), payload]),
                          lambda: bool(c.recv_multipart()), n, window)
        cpu = [(cpu_seconds(p.pid) - c0) / n * 1e6 for p, c0 in zip(procs, cpu0, strict=True)]
        return {"rps": n / wall, "cpu_us": cpu[0]}, {"rps": n / wall, "cpu_us": cpu[1]}
    finally:
        c.close(linger=0)
        ctx.term()
        stop_processes(procs, timeout_s=5)


def run(*, n: int, window: int, repeats: int, pad_kb: int = 0) -> dict[str, dict[str, float]]:
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(repeats):  # interleaved, so drift hits every row alike
        rows.setdefault("broker", []).append(measure_broker(n, window, pad_kb))
        rows.setdefault("worker (transport mode)", []).append(measure_worker(n, window, pad_kb))
        relay, echo = measure_floor(n, window, pad_kb)
        rows.setdefault("relay (zmq.proxy, C)", []).append(relay)
        rows.setdefault("echo (pyzmq, sync)", []).append(echo)
    return {name: {k: median([r[k] for r in runs]) for k in ("rps", "cpu_us")}
            for name, runs in rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", choices=["echo-worker", "transport-worker"], help=argparse.SUPPRESS)
    ap.add_argument("endpoint", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("-n", type=int, default=5000, help="requests per measurement (default 5000)")
    ap.add_argument("--window", type=int, default=4, help="requests in flight (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row; the median is shown (default 3)")
    ap.add_argument("--pad-kb", type=int, default=0, help="pad the request with about this many KiB of messages")
    args = ap.parse_args(argv)
    if args.role == "echo-worker":
        echo_worker(args.endpoint)
        return 0
    if args.role == "transport-worker":
        transport_worker(args.endpoint)
        return 0
    result = run(n=args.n, window=args.window, repeats=args.repeats, pad_kb=args.pad_kb)
    size = len(encode(template(args.pad_kb)))
    print(f"CPU per request, median of {args.repeats} (n={args.n}, window {args.window}, request {size:,} bytes):\n")
    print("\n".join(table(["process", "req/s", "CPU µs per request"],
                          [[name, f"{r['rps']:.0f}", f"{r['cpu_us']:.0f}"] for name, r in result.items()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
