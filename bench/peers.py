"""``python -m bench.peers [--quick]``: this stack against the same pipeline served the way a user
would otherwise serve it, in one run, interleaved.

Three systems share one embedded Redis and one memory service seeded with the demo data:

* ``ibex``: this stack (broker + 2 pinned workers, ``ibex_context.ops.local.LocalStack``), driven
  through the real ``AsyncClient`` (its adaptive throttle as configured, ``IBEX_CLIENT_THROTTLE_K``;
  a ``--baseline`` checkout's client has it off, the "before" of a change to the client, unless
  ``--baseline-client same``: then both arms' clients are alike and only the servers differ);
* ``grpc``: 2 grpc.aio processes on one SO_REUSEPORT port (``bench.peer_servers``), driven by a
  grpc.aio client over 8 channels;
* ``http``: 2 uvicorn/Starlette processes (uvloop + httptools) on one SO_REUSEPORT port, driven by
  aiohttp over a keep-alive pool.

Each peer runs this project's ``Assembler`` and codec, so only the serving differs. Load is the
open-loop Poisson generator of ``bench.loadgen`` (one generator, one process); systems take turns
within every round, in rotated order, so machine drift hits all alike. Phases:

* ``transport``: each server answers a canned minimal reply (the stack's workers are
  ``bench.lib.transport``); CPU per request and latency at ``--transport-rate``. A fourth system,
  ``zmq-floor``, runs here only: ``zmq.proxy`` (C) in front of two bare processes that answer in
  the protocol (``python -m bench.floor answer``), driven by the same client library: the floor of
  the design's two ZeroMQ hops, with no Python broker and no worker server.
* ``full``: a ladder of offered rates; per system the highest rate with >= 90 % undegraded
  on-time replies and p99 under the deadline (its saturation), then a run at 2x its own
  saturation: on-time replies, undegraded on-time replies as a share of its undegraded peak,
  requests shed (OVERLOADED) and how fast, replies after deadline + 5 ms. With ``--new-questions``
  also runs at 4x and 8x its own saturation (``deep_overloads``), each a round over every system.

Server CPU (``bench.lib.cpu``) of every server process (broker and workers, or the two peer
processes) is read around each run and divided by the replies of that run; the memory
service and Redis are reported separately, and the sum of all four as full-system CPU. Each run
ends when the memory service and Redis are idle again (``settle``: calls abandoned at the retrieval
wall still run to the end there), so that work is charged to the run that sent it and no run
starts against a service still busy with the last one.

``--new-questions``: in the full phase every request asks a question never sent before
(``bench.questions``, shared by all systems so none answers from another's cached embedding), as a
proxy's calls do; the memory service's query embedding is then paid on every assembly and
dominates the system's CPU. Without it the requests repeat a few dozen questions.

Outputs: ``bench/out/peers.json`` and ``peers.md``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.cpu import tree_cpu_seconds
from bench.lib.stack import (
    FULL_WORKER,
    OUT,
    TRANSPORT_WORKER,
    connected_client,
    git_commit,
    new_stack,
    runner,
    seed_demo,
    set_workers,
    settle,
    spawn_module,
    start_baseline,
)
from bench.loadgen import OK, RunResult, Sample, merge_runs, open_loop
from bench.peer_report import markdown
from bench.peer_servers import READY_LINE
from bench.peer_targets import GrpcTarget, HttpTarget
from bench.stats import Histograms
from bench.workload import Requests, request_templates
from ibex_context.client.client import AsyncClient
from ibex_context.ops.local import LocalStack
from ibex_context.ops.procs import stop_processes, wait_for
from ibex_context.ops.stack import free_port
from ibex_context.shared.config.settings import ClientSettings
from ibex_context.shared.wire import protocol as P

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("ibex", "grpc", "http")
FLOOR = "zmq-floor"  # transport phase only: zmq.proxy (C) + 2 bare answering processes, no Python broker


@dataclass
class PeerPlan:
    deadline_ms: float = 100.0
    transport_rate: float = 1000.0
    transport_rounds: int = 3
    transport_s: float = 2.0
    # Up to where the previous ladder (top 540/s) left every system still healthy, and beyond.
    rates: list[float] = field(default_factory=lambda: [120.0, 240.0, 360.0, 480.0, 600.0, 720.0, 840.0, 960.0])
    point_s: float = 3.0
    overload_factor: float = 2.0
    deep_overload_factors: tuple[float, ...] = ()  # further overload runs (--new-questions: 4x and 8x)
    overload_s: float = 4.0
    pause_s: float = 0.5
    warmup: int = 30
    seed: int = 18
    systems: tuple[str, ...] = SYSTEMS
    baseline: str | None = None  # a checkout of this project to run as "ibex-base" beside the others
    baseline_client: str = "off"  # the baseline's client throttle: "off" (the before) or "same" as ibex's
    new_questions: bool = False  # every send a question never asked before (bench.questions): the embedding is paid
    floor: bool = True  # add FLOOR to the transport phase: the card's two hops with nothing in Python but the answer

    def overload_factors(self) -> tuple[float, ...]:
        return (self.overload_factor, *self.deep_overload_factors)

    def transport_systems(self) -> tuple[str, ...]:
        return (*self.systems, FLOOR) if self.floor and "ibex" in self.systems else self.systems


# A new question costs the memory service an encoder pass, so saturation comes far lower.
# ... and far past it: what serving does to embedding work it cannot finish (4x and 8x saturation).
NEW_QUESTION_DEEP_OVERLOADS = (4.0, 8.0)
NEW_QUESTION_RATES = [50.0, 100.0, 150.0, 200.0, 250.0, 300.0, 400.0, 500.0, 600.0]
QUICK = {"transport_rate": 200.0, "transport_rounds": 1, "transport_s": 0.5, "rates": [40.0, 80.0],
         "point_s": 0.6, "overload_s": 0.6, "pause_s": 0.0, "warmup": 5}


# ---------------------------------------------------------------------------------- the systems


def baseline_tag(checkout: Path) -> bytes | None:
    """The protocol tag a checkout of this project speaks (None if it cannot be read): the client
    library talks only to a baseline of its own protocol generation."""
    for rel in ("shared/wire/protocol/__init__.py", "shared/protocol.py"):
        path = checkout / rel
        if path.is_file():
            found = re.search(r'^TAG = b"([A-Z0-9]+)"', path.read_text("utf-8"), re.M)
            return found[1].encode() if found else None
    return None


@dataclass
class Servers:
    stack: LocalStack
    peers: dict[str, tuple[int, list[subprocess.Popen[bytes]]]]  # kind -> (port, processes)
    base: LocalStack | None = None  # the baseline checkout's broker and workers (same Redis, memory)
    floor: tuple[str, list[subprocess.Popen[bytes]]] | None = None  # (relay frontend, relay + answerers)

    def stacks(self) -> list[LocalStack]:
        return [self.stack] + ([self.base] if self.base is not None else [])

    def pids(self, system: str) -> list[int]:
        if system in ("ibex", "ibex-base"):
            st = self.stack if system == "ibex" else self.base
            assert st is not None
            procs = [st.broker, *st.workers]
            return [p.pid for p in procs if p is not None and p.poll() is None]
        if system == FLOOR:
            assert self.floor is not None
            return [p.pid for p in self.floor[1]]
        return [p.pid for p in self.peers[system][1]]

    def backend_pids(self) -> list[int]:
        pids = [self.stack.memory.pid] if self.stack.memory is not None else []
        if self.stack.embedded is not None and self.stack.embedded.pid is not None:
            pids.append(self.stack.embedded.pid)
        return pids


_cpu = tree_cpu_seconds


@contextlib.contextmanager
def started(plan: PeerPlan, log_dir: Path) -> Iterator[Servers]:
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = new_stack(workers=2, log_dir=log_dir, worker_module=TRANSPORT_WORKER)
    peers: dict[str, tuple[int, list[subprocess.Popen[bytes]]]] = {}
    base: LocalStack | None = None
    floor: tuple[str, list[subprocess.Popen[bytes]]] | None = None
    try:
        if FLOOR in plan.transport_systems():  # needs no stack: starts up while the stack does
            floor = _start_floor(log_dir)
        stack.start()
        # The peers start up while the demo data is seeded: their warm-up needs Redis and the memory service, no data.
        for kind in plan.systems:
            if kind.startswith("ibex"):
                continue
            port = free_port()
            procs = [spawn_module("bench.peer_servers", [kind, str(port), f"{kind}-{i}"], env=stack.env(),
                                  log=log_dir / f"{kind}-{i}.log") for i in range(2)]
            peers[kind] = (port, procs)
        seed_demo(str(stack.redis_url))
        if plan.baseline is not None:
            base = start_baseline(stack, plan.baseline, log_dir / "base", workers=2, worker_module=TRANSPORT_WORKER)
        for kind, (_, procs) in peers.items():
            for i, proc in enumerate(procs):
                log = log_dir / f"{kind}-{i}.log"
                wait_for(f"{kind} peer {i}", lambda log=log: READY_LINE in log.read_text(errors="replace"), 60, log)
                if proc.poll() is not None:
                    raise RuntimeError(f"{kind} peer {i} exited: {log.read_text()[-2000:]}")
        yield Servers(stack, peers, base, floor)
    finally:
        stop_processes([p for _, ps in [*peers.values(), *([floor] if floor else [])] for p in ps], timeout_s=5)
        if base is not None:
            base.stop()
        stack.stop()


def _start_floor(log_dir: Path) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """``bench.floor``'s zmq.proxy relay with two answering processes behind it (``FLOOR``)."""
    front, back = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    roles = [("relay", ["relay", front, back]), ("answer-0", ["answer", back]), ("answer-1", ["answer", back])]
    return front, [spawn_module("bench.floor", args, log=log_dir / f"floor-{name}.log") for name, args in roles]


class Targets:
    """One open target per system for a phase (``method``: transport or full)."""

    def __init__(self, servers: Servers, plan: PeerPlan, method: str) -> None:
        self.servers, self.plan, self.method = servers, plan, method
        self.calls: dict[str, Any] = {}
        self.clients: list[Any] = []
        self.templates = Requests(request_templates(seed=plan.seed),
                                  new_questions=plan.new_questions and method == "full")

    async def open(self, tag: str) -> None:
        from bench.loadgen import ClientTarget

        systems = self.plan.transport_systems() if self.method == "transport" else self.plan.systems
        for system in systems:
            if system == FLOOR:
                assert self.servers.floor is not None
                self.clients.append(await connected_client(self.servers.floor[0]))
                self.calls[system] = ClientTarget(self.clients[-1], self.templates, tag=f"floor-{tag}")
            elif system == "ibex":
                self.clients.append(await connected_client(self.servers.stack.frontend))
                self.calls[system] = ClientTarget(self.clients[-1], self.templates, tag=f"ibex-{tag}")
            elif system == "ibex-base":
                assert self.servers.base is not None
                assert self.plan.baseline is not None
                # The baseline is "before": its client has no adaptive throttle either, unless the
                # run compares servers only ("same": the client ibex is driven with).
                settings = ClientSettings() if self.plan.baseline_client == "same" else ClientSettings(
                    client_throttle_k=0)
                legacy = AsyncClient(self.servers.base.frontend, settings=settings)
                await legacy.wait_connected(10.0)
                await legacy.prepare_fallback()
                self.clients.append(legacy)
                self.calls[system] = ClientTarget(legacy, self.templates, tag=f"base-{tag}")
            elif system == "grpc":
                self.calls[system] = GrpcTarget(self.servers.peers["grpc"][0], self.templates,
                                                method="Transport" if self.method == "transport" else "Assemble",
                                                tag=f"grpc-{tag}")
            else:
                self.calls[system] = HttpTarget(self.servers.peers["http"][0], self.templates,
                                                path="/transport" if self.method == "transport" else "/assemble",
                                                tag=f"http-{tag}")
        for system, call in self.calls.items():
            if system == "grpc":
                await call.ready()
        for system, call in self.calls.items():  # every server up and answering before any clock starts
            await _wait_ok(system, call)
            for k in range(self.plan.warmup):
                await call(10_000_000 + k, 2.0)

    async def aclose(self) -> None:
        for system, call in self.calls.items():
            if system in ("grpc", "http"):
                await call.aclose()
        for c in self.clients:
            await c.aclose()


async def _wait_ok(system: str, call: Any, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    last = ""
    k = 0
    while time.monotonic() < end:
        k += 1
        reply = await call(20_000_000 + k, 1.0)
        if reply.outcome == OK:
            return
        last = reply.outcome
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{system} did not answer OK within {timeout_s:.0f} s (last outcome {last})")


# ---------------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    run: RunResult
    server_cpu_s: float
    backend_cpu_s: float
    settle_s: float = 0.0  # how long the memory service and Redis worked on after the run (settle)
    broker: dict[str, Any] = field(default_factory=dict)  # this stack's counter deltas and worker limits


async def _one(servers: Servers, targets: Targets, system: str, rate: float, duration_s: float,
               seed: int, label: str) -> Measured:
    pids, back = servers.pids(system), servers.backend_pids()
    st = {"ibex": servers.stack, "ibex-base": servers.base}.get(system)
    before = await asyncio.to_thread(st.status, 1.0) if st is not None else None
    c0, b0 = _cpu(pids), _cpu(back)
    run = await open_loop(targets.calls[system], rate=rate, duration_s=duration_s,
                          deadline_ms=targets.plan.deadline_ms, label=label, seed=seed,
                          meta={"system": system, "mode": targets.method})
    settled_s = await settle(back)
    m = Measured(run, _cpu(pids) - c0, _cpu(back) - b0, settled_s)
    after = await asyncio.to_thread(st.status, 1.0) if st is not None else None
    if before and after:
        m.broker = {"stats": {k: v - before["stats"].get(k, 0) for k, v in after["stats"].items()
                              if v != before["stats"].get(k, 0)},
                    "limits": {w: info.get("limit") for w, info in after["workers"].items()}}
    await asyncio.sleep(targets.plan.pause_s)
    return m


def summarize(ms: list[Measured]) -> dict[str, Any]:
    """One row: the loadgen summary of the merged runs, plus CPU per reply and the shed requests."""
    run = merge_runs([m.run for m in ms], ms[0].run.label)
    s = run.summary()
    replies = max(1, s["responses"])
    s["server_cpu_us_per_reply"] = round(sum(m.server_cpu_s for m in ms) / replies * 1e6, 1)
    s["backend_cpu_us_per_reply"] = round(sum(m.backend_cpu_s for m in ms) / replies * 1e6, 1)
    s["system_cpu_us_per_reply"] = round(s["server_cpu_us_per_reply"] + s["backend_cpu_us_per_reply"], 1)
    s["undegraded_fraction"] = round(s["complete_rps"] * s["duration_s"] / max(1, s["scheduled"]), 4)
    s["shed"] = _shed(run.samples)
    s["backend_settle_s"] = max(m.settle_s for m in ms)
    if ms[-1].broker:
        s["broker"] = ms[-1].broker if len(ms) == 1 else {"limits": ms[-1].broker.get("limits")}
    return s


def _shed(samples: list[Sample]) -> dict[str, Any]:
    hs = Histograms()
    n = 0
    for x in samples:
        if x.reply.outcome == "OVERLOADED":
            n += 1
            hs.record("shed", x.latency_ns / 1000)
    return {"count": n, "latency_us": hs.summary(("shed",)).get("shed") if n else None}


def _healthy_undegraded(s: dict[str, Any], deadline_ms: float) -> bool:
    lat = s["latency_us"].get("latency")
    p99 = None if not lat else lat.get("p99")
    return p99 is not None and p99 < deadline_ms * 1000 and s["undegraded_fraction"] >= 0.9


def _order(plan: PeerPlan, k: int, systems: tuple[str, ...] | None = None) -> list[str]:
    order = list(plan.systems if systems is None else systems)
    return order[k % len(order):] + order[:k % len(order)]


async def transport_phase(servers: Servers, plan: PeerPlan) -> dict[str, Any]:
    targets = Targets(servers, plan, "transport")
    await targets.open("t")
    try:
        systems = plan.transport_systems()
        runs: dict[str, list[Measured]] = {s: [] for s in systems}
        for k in range(plan.transport_rounds):
            for system in _order(plan, k, systems):
                runs[system].append(await _one(servers, targets, system, plan.transport_rate, plan.transport_s,
                                               plan.seed * 100 + k, f"{system} transport {plan.transport_rate:.0f}/s"))
        return {system: summarize(runs[system]) for system in systems}
    finally:
        await targets.aclose()


async def full_phase(servers: Servers, plan: PeerPlan) -> dict[str, Any]:
    targets = Targets(servers, plan, "full")
    await targets.open("f")
    try:
        ladder: dict[str, list[dict[str, Any]]] = {s: [] for s in plan.systems}
        for k, rate in enumerate(plan.rates):
            for system in _order(plan, k):
                m = await _one(servers, targets, system, rate, plan.point_s, plan.seed * 1000 + k,
                               f"{system} full {rate:.0f}/s")
                ladder[system].append(summarize([m]))
        sats: dict[str, float | None] = {}
        for system in plan.systems:
            ok = [p["offered_rps"] for p in ladder[system] if _healthy_undegraded(p, plan.deadline_ms)]
            sats[system] = max(ok, default=None)
        over: dict[str, dict[float, dict[str, Any]]] = {s: {} for s in plan.systems}
        for i, factor in enumerate(plan.overload_factors()):  # each factor a round over every system
            for j, system in enumerate(_order(plan, len(plan.rates) + i)):
                rate = factor * (sats[system] or plan.rates[0])
                m = await _one(servers, targets, system, rate, plan.overload_s, plan.seed * 7 + j + 100 * i,
                               f"{system} overload {factor:g}x {rate:.0f}/s")
                over[system][factor] = summarize([m]) | {"factor": factor}
        out: dict[str, Any] = {}
        for system in plan.systems:
            pts, runs = ladder[system], list(over[system].values())
            peak = max(p["complete_rps"] for p in [*pts, *runs])
            peak_replies = max(p["goodput_rps"] for p in [*pts, *runs])
            for o in runs:
                o["undegraded_share_of_peak"] = round(o["complete_rps"] / peak, 4) if peak else None
                o["replies_share_of_peak"] = round(o["goodput_rps"] / peak_replies, 4) if peak_replies else None
            out[system] = {"ladder": pts, "saturation_rps": sats[system], "undegraded_peak_rps": peak,
                           "overload": runs[0], "deep_overloads": runs[1:]}
        return {system: out[system] for system in plan.systems}
    finally:
        await targets.aclose()


def run(plan: PeerPlan, out_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"meta": {"started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                        "commit": git_commit(), "plan": plan.__dict__}}
    t0 = time.monotonic()
    with runner() as loop, started(plan, out_dir / "peer-logs") as servers:
        results["transport"] = loop.run(transport_phase(servers, plan))
        for st in servers.stacks():
            set_workers(st, 0)
            st.worker_module = FULL_WORKER
            set_workers(st, 2)
        results["full"] = loop.run(full_phase(servers, plan))
    results["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per phase")
    ap.add_argument("--rates", help="full-mode ladder, req/s, comma-separated")
    ap.add_argument("--transport-rate", type=float)
    ap.add_argument("--point", type=float, help="seconds per ladder point")
    ap.add_argument("--systems", help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--baseline", type=Path,
                    help="another checkout of this project (e.g. a git worktree of main), run as 'ibex-base' in "
                         "the same interleaved rounds: before/after under the same machine state")
    ap.add_argument("--baseline-client", choices=("off", "same"), default="off",
                    help="the baseline's client: 'off' (adaptive throttle off, the before of a client change) or "
                         "'same' as ibex's (only the servers differ)")
    ap.add_argument("--new-questions", action="store_true",
                    help="full mode: every request a question never sent before, so the memory service embeds each one")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    plan = PeerPlan(**(QUICK if args.quick else {}))
    plan.new_questions = args.new_questions
    if args.new_questions:
        plan.deep_overload_factors = NEW_QUESTION_DEEP_OVERLOADS
    if args.new_questions and not args.quick:
        plan.rates = list(NEW_QUESTION_RATES)
    if args.rates:
        plan.rates = [float(x) for x in args.rates.split(",")]
    if args.transport_rate:
        plan.transport_rate = args.transport_rate
    if args.point:
        plan.point_s = args.point
    if args.systems:
        plan.systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if args.baseline:
        tag = baseline_tag(args.baseline.resolve())
        if tag != P.TAG:
            ap.error(f"--baseline {args.baseline} speaks protocol {tag!r}, this client {P.TAG!r}: "
                     "compare against a checkout of the same protocol generation")
        plan.baseline = str(args.baseline.resolve())
        plan.baseline_client = args.baseline_client
        plan.systems = (*plan.systems, "ibex-base")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(plan, args.out)
    (args.out / "peers.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = markdown(results)
    (args.out / "peers.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

