"""``python -m bench.workercpu [--baseline DIR]``: a full-mode worker's CPU per served assembly,
beside the CPU of the in-process pipeline for the same requests.

One embedded Redis and one memory service seeded with the demo data (``ops.local.LocalStack``,
no workers of its own); each measured worker is a real ``python -m ibex_context.worker`` process
(full mode, not pinned) behind a bare ROUTER that plays the broker, as ``bench.hops.measure_worker``
does for transport mode. The ROUTER sends the demo requests (``bench.workload.request_templates``)
at a fixed rate, each with a deadline ``--deadline-ms`` after its scheduled send, and reads every
reply; the worker's CPU (all threads, ``bench.lib.cpu``) around each round is divided by
the replies of that round.

``--baseline DIR`` runs another checkout's worker (e.g. ``git worktree add /work/base main
--detach``) in the same run: the workers take turns within every round, in rotated order, so
drift on the shared machine hits both alike. Medians over rounds are printed.

The ``pipeline`` row is this process running, for the same requests, what a worker runs between
retrieval and the reply's bytes: ``count_turns`` + ``pipeline.assemble.assemble`` on a retrieval
result fetched once from the same memory service and Redis (``worker.retrieve.Retriever``), with
one worker's line cache and a warm token cache; ``codec`` adds decoding the request and encoding
the reply (``shared.wire.codec``); ``hit parsing`` is ``worker.retrieve.parse_hits`` on the hot
and cold answers the memory service gave each request. CPU is this thread's (``bench.lib.cpu``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import orjson
import zmq

from bench.lib.checkout import pythonpath
from bench.lib.cpu import cpu_seconds, thread_cpu_seconds
from bench.lib.percentiles import median
from bench.lib.stack import seed_demo, spawn_module
from bench.lib.tables import table
from bench.workload import request_templates
from ibex_context.ops.local import LocalStack
from ibex_context.ops.procs import stop_processes
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import decode_request, encode
from ibex_context.shared.wire.models import AssembleRequest
from ibex_context.shared.wire.protocol import Envelope, pack_header

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Worker:
    """One measured worker process and the ROUTER it is connected to."""

    name: str
    proc: subprocess.Popen[bytes]
    router: zmq.Socket[bytes]
    ident: bytes = b""


def _spawn_worker(stack: LocalStack, checkout: Path, endpoint: str, name: str, log_dir: Path,
                  extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = stack.env()
    # The checkout's own package (bench.lib.checkout): not this venv's editable install of today's code.
    env.update({"IBEX_BROKER_BACKENDS": endpoint, "IBEX_BROKER_BACKEND": endpoint, "IBEX_PIN_CPUS": "false",
                "PYTHONPATH": pythonpath(checkout), **extra_env})
    return spawn_module("ibex_context.worker", ["--worker-id", name], env=env, log=log_dir / f"{name}.log",
                        cwd=checkout, new_session=True)


def _connect(w: Worker, timeout_s: float = 60.0) -> None:
    """Wait for the worker's READY (it connects after warming up its Redis and HTTP pools)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if w.proc.poll() is not None:
            raise RuntimeError(f"worker {w.name} exited with {w.proc.returncode} (see its log)")
        if w.router.poll(200):
            f = w.router.recv_multipart()
            if len(f) >= 3 and f[2] == P.READY:
                w.ident = f[0]
                return
    raise RuntimeError(f"worker {w.name} did not connect within {timeout_s:.0f} s")


def _frames(tmpls: list[AssembleRequest], n: int, start_ns: int, rate: float, deadline_ms: float,
            tag: str) -> list[tuple[int, list[bytes]]]:
    """(epoch send time, dispatch frames) for ``n`` requests at ``rate``/s from ``start_ns``."""
    out = []
    for i in range(n):
        at = start_ns + int(i * 1e9 / rate)
        deadline = at + int(deadline_ms * 1e6)
        t = tmpls[i % len(tmpls)]
        rid = f"{tag}-{i}"
        req = t.model_copy(update={"request_id": rid, "deadline_ns": deadline})
        header = pack_header(Envelope(rid, t.org_id, t.agent_id, deadline))
        out.append((at, [P.TAG, P.REQUEST, b"client", rid.encode(), b"", header, encode(req)]))
    return out


def drive(w: Worker, tmpls: list[AssembleRequest], *, n: int, rate: float, deadline_ms: float,
          tag: str) -> dict[str, float]:
    """Send ``n`` requests at ``rate``/s (absolute schedule) and collect every answer."""
    start = time.time_ns() + 200_000_000
    plan = _frames(tmpls, n, start, rate, deadline_ms, tag)
    while w.router.poll(0):  # heartbeats that arrived between rounds
        w.router.recv_multipart()
    counts = {"replies": 0, "errors": 0, "degraded": 0}
    gc.collect()
    gc.disable()
    cpu0, main0 = cpu_seconds(w.proc.pid), thread_cpu_seconds(w.proc.pid)
    sent = answered = 0
    end = start + int((n / rate + 2.0) * 1e9)
    try:
        while answered < n and time.time_ns() < end:
            now = time.time_ns()
            while sent < n and plan[sent][0] <= now:
                at, frames = plan[sent]
                frames[4] = P.Stamp(at + int(deadline_ms * 1e6), 0, now, 1).pack()
                w.router.send_multipart([w.ident, *frames])
                sent += 1
            wait_ms = 0 if sent >= n else max(0, (plan[sent][0] - time.time_ns()) // 1_000_000)
            if w.router.poll(wait_ms if sent < n else 100):
                f = w.router.recv_multipart()
                if len(f) < 6 or f[2] not in (P.REPLY, P.ERROR):
                    continue
                answered += 1
                if f[2] == P.ERROR:
                    counts["errors"] += 1
                    continue
                counts["replies"] += 1
                counts["degraded"] += bool(msgpack.unpackb(f[5]).get("degraded"))
        cpu, main = cpu_seconds(w.proc.pid) - cpu0, thread_cpu_seconds(w.proc.pid) - main0
    finally:
        gc.enable()
    per = max(1, answered)
    return {**counts, "sent": sent, "cpu_us": cpu / per * 1e6, "main_us": main / per * 1e6}


def _py_spy(w: Worker, out_dir: Path, seconds: float, native: bool) -> subprocess.Popen[bytes]:
    """py-spy (non-blocking sampling, 1000 Hz) on ``w`` for one round: collapsed stacks, one file a
    worker, to sum with ``python -m bench.spy``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    out = out_dir / f"{w.name.replace(' ', '-')}.txt"
    mode = ["--native"] if native else ["--nonblocking"]  # native frames need the process paused
    return subprocess.Popen([str(spy), "record", "--pid", str(w.proc.pid), "--duration", str(max(1, int(seconds))),
                             "--rate", "1000", *mode, "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ------------------------------------------------------------------------------ in-process pipeline


def pipeline_cpu(stack: LocalStack, tmpls: list[AssembleRequest], iterations: int) -> dict[str, float]:
    """CPU µs per request of what a worker runs after retrieval, in this process, for ``tmpls``."""
    from ibex_context.pipeline.assemble import Clock, Engine, Policy, assemble
    from ibex_context.pipeline.budget.catalog import Catalog
    from ibex_context.pipeline.budget.usable import counter_for
    from ibex_context.pipeline.counting.count import LineCache
    from ibex_context.pipeline.rendering.turns import count_turns
    from ibex_context.shared.config.settings import Settings
    from ibex_context.worker.retrieve import HOT_QUERY_CHARS, Retriever, parse_hits

    settings = Settings(memory_url=stack.memory_url, memory_secret=stack.secret, redis_url=stack.redis_url)

    bodies: list[tuple[bytes, bytes]] = []  # each request's hot and cold answers, as the worker reads them

    async def fetch() -> list[Any]:
        r = Retriever.create(settings, str(stack.redis_url))
        try:
            out = []
            for t in tmpls:
                wait = r.start(t, wall_end_ns=time.monotonic_ns() + 2_000_000_000)
                out.append(await wait())
                params = {"agent_id": t.agent_id, "limit": str(settings.hot_limit)}
                if t.query:
                    params["query"] = t.query[:HOT_QUERY_CHARS]
                search = orjson.dumps({"query": t.query, "agent_id": t.agent_id, "limit": settings.cold_limit})
                bodies.append((await r._fetch("GET", "/v1/memories/hot", t.org_id, params=params),
                               await r._fetch("POST", "/v1/memories/search", t.org_id, body=search)))
            return out
        finally:
            await r.aclose()

    results = asyncio.run(fetch())
    catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries)
    catalog.warm_up()
    engine = Engine(catalog, Policy.from_settings(settings), lines=LineCache(), worker_id="bench")
    payloads = [encode(t) for t in tmpls]

    def once(i: int, codec: bool) -> None:
        t = decode_request(payloads[i]) if codec else tmpls[i]
        assert isinstance(t, AssembleRequest)
        spec = catalog.model(t.model)
        counted = count_turns(t, spec, counter_for(catalog, spec, None))
        resp = assemble(t, results[i], engine, counted=counted, clock=Clock(time.monotonic_ns() + 10**12, t.request_id))
        if codec:
            encode(resp)

    out = {}
    for codec in (False, True):
        for i in range(len(tmpls)):  # warm the token and line caches, as a serving worker's are
            once(i, codec)
        gc.collect()
        t0 = thread_cpu_seconds()
        for k in range(iterations):
            once(k % len(tmpls), codec)
        out["pipeline + codec" if codec else "pipeline"] = (thread_cpu_seconds() - t0) / iterations * 1e6
    t0 = thread_cpu_seconds()
    for k in range(iterations):
        hot, cold = bodies[k % len(bodies)]
        parse_hits(hot, "hot", settings.hot_limit)
        parse_hits(cold, "cold", settings.cold_limit)
    out["hit parsing (hot + cold answers)"] = (thread_cpu_seconds() - t0) / iterations * 1e6
    return out


# -------------------------------------------------------------------------------------------- run


@contextlib.contextmanager
def started(checkouts: dict[str, Path], log_dir: Path, extra_env: dict[str, str]) -> Iterator[
        tuple[LocalStack, list[Worker]]]:
    stack = LocalStack(workers=0, log_dir=log_dir, brokers=0)  # the ROUTER of each worker plays the broker
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    workers: list[Worker] = []
    try:
        stack.start()
        for name, path in checkouts.items():  # they start up while the demo data is seeded (no request before)
            r = ctx.socket(zmq.ROUTER)
            r.setsockopt(zmq.LINGER, 0)
            port = r.bind_to_random_port("tcp://127.0.0.1")
            proc = _spawn_worker(stack, path, f"tcp://127.0.0.1:{port}", name, log_dir, extra_env)
            workers.append(Worker(name, proc, r))
        seed_demo(str(stack.redis_url))
        for w in workers:
            _connect(w)
        yield stack, workers
    finally:
        stop_processes([w.proc for w in workers], timeout_s=5)
        for w in workers:
            w.router.close(linger=0)
        ctx.term()
        stack.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"this checkout": REPO}
    if args.baseline:
        checkouts["baseline"] = Path(args.baseline).resolve()
    tmpls = request_templates(seed=9)
    log_dir = Path(tempfile.mkdtemp(prefix="ibex-workercpu-"))
    rows: dict[str, list[dict[str, float]]] = {}
    with started(checkouts, log_dir, dict(kv.split("=", 1) for kv in args.env)) as (stack, workers):
        for w in workers:  # warm-up: caches, pools, first-call costs
            drive(w, tmpls, n=args.warmup, rate=args.rate, deadline_ms=args.deadline_ms, tag="warm")
        for rnd in range(args.rounds):
            order = workers[rnd % len(workers):] + workers[:rnd % len(workers)]
            for w in order:
                spy = None
                if args.profile and rnd == 0:
                    spy = _py_spy(w, Path(args.profile), args.n / args.rate, args.native)
                rows.setdefault(w.name, []).append(
                    drive(w, tmpls, n=args.n, rate=args.rate, deadline_ms=args.deadline_ms, tag=f"r{rnd}"))
                if spy is not None:
                    spy.wait(30)
        inproc = pipeline_cpu(stack, tmpls, args.iterations)
    print(f"logs: {log_dir}", file=sys.stderr)
    return {"rows": rows, "inproc": inproc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workercpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another checkout whose worker runs interleaved in the same run")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    ap.add_argument("-n", type=int, default=600, help="requests per worker per round (default 600)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; medians are shown (default 5)")
    ap.add_argument("--warmup", type=int, default=200, help="requests per worker before timing (default 200)")
    ap.add_argument("--deadline-ms", type=float, default=100.0, help="each request's deadline (default 100)")
    ap.add_argument("--iterations", type=int, default=2000, help="in-process pipeline runs (default 2000)")
    ap.add_argument("--profile", metavar="DIR", help="record each worker with py-spy during the first round")
    ap.add_argument("--native", action="store_true", help="with --profile: native (C) frames too (pauses the worker)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra worker environment")
    args = ap.parse_args(argv)
    result = run(args)
    print(f"\nworker CPU per answered request at {args.rate:.0f}/s, {args.n} requests a round, median of "
          f"{args.rounds} rounds (min-max), pid CPU of all threads:\n")
    body = []
    for name, runs in result["rows"].items():
        cpu = [r["cpu_us"] for r in runs]
        ans = sum(r["replies"] + r["errors"] for r in runs)
        body.append([name, f"{median(cpu):.0f}", f"{min(cpu):.0f}-{max(cpu):.0f}",
                     f"{median([r['main_us'] for r in runs]):.0f}",
                     f"{sum(r['degraded'] for r in runs) / max(1, ans):.1%}",
                     f"{sum(r['errors'] for r in runs)}", f"{sum(r['sent'] for r in runs) - ans}"])
    for name, us in result["inproc"].items():
        body.append([f"in-process {name}", f"{us:.0f}", "", "", "", "", ""])
    print("\n".join(table(["worker", "CPU µs per request", "range", "of which main thread", "degraded", "errors",
                            "unanswered"], body)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
