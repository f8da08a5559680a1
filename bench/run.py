"""``python -m bench.run [--quick] [--modes ...]``: the stack under open-loop load.

Without ``--endpoint`` the harness starts its own stack (``ibex_context.ops.stack.LocalStack``: embedded
Redis, memory service, broker, workers) and seeds the demo data. Phases, in order:

* ``inproc``: the CPU pipeline alone (``bench.inproc``), warm and cold token-count cache;
* ``transport``: workers answer at once; a short ramp finds saturation, then a run at half of it;
* ``floor``: bare pyzmq relay and ping-pong (``bench.floor``), right after the transport run, at
  the same offered rate, so the two are compared on the same machine state;
* ``full``: for each worker count 1..usable CPUs, a ramp to find saturation, then a sweep of
  offered rates from light load to 2x saturation; the knee is the highest rate whose p99 (every
  sent request, errors at their observed time) is under the deadline with <= 1 % errors;
* ``chaos``: on the full stack, kill -9 one worker under steady load, restart it, count outcomes.

Load is open-loop Poisson (``bench.loadgen``) through the real ``AsyncClient``. Outputs go to
``bench/out``: results.json, results.md and PNG plots. Nothing is asserted: targets are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

from bench import floor, inproc
from bench.chaos import run_chaos
from bench.lib.stack import (
    FULL_WORKER,
    OUT,
    TRANSPORT_WORKER,
    connected_client,
    git_commit,
    runner,
    set_workers,
    started_stack,
)
from bench.loadgen import ClientTarget, RunResult, merge_runs, open_loop
from bench.stats import Histograms
from bench.workload import Requests, request_templates
from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack, broker_status
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.models import AssembleRequest

MODES = ("inproc", "transport", "floor", "full", "chaos")
KNEE_MAX_ERROR_FRACTION = 0.01


@dataclass
class Plan:
    """Every knob of one bench run (defaults: the full run, about 3-4 minutes on 2 cores)."""

    deadline_ms: float = 100.0
    workers: list[int] = field(default_factory=lambda: list(range(1, len(os.sched_getaffinity(0)) + 1)))
    # full-mode saturation ramp and sweep
    ramp_start_rps: float = 40.0
    ramp_factor: float = 1.5
    ramp_step_s: float = 1.5
    ramp_max_steps: int = 10
    fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0])
    rates: list[float] = field(default_factory=list)  # explicit offered rates replace ramp x fractions
    point_s: float = 4.0
    # transport mode and floor
    transport_ramp_start_rps: float = 100.0
    transport_ramp_factor: float = 1.6
    transport_step_s: float = 1.0
    transport_max_steps: int = 10
    transport_s: float = 6.0  # split into ``segments`` transport / floor-relay A/B segments
    segments: int = 4
    closed_loop: int = 300  # transport-mode requests one at a time
    floor_rate: float | None = None  # floor alone (no transport phase); default 200
    pingpongs: int = 2000
    # inproc
    inproc_iterations: int = 300
    inproc_cold_iterations: int = 60
    # chaos
    chaos_s: float = 10.0
    chaos_fraction: float = 0.5
    chaos_rate: float | None = None
    pause_s: float = 0.4
    seed: int = 9
    new_questions: bool = False  # full and chaos: every request a question never sent before (bench.questions)
    fresh_workers: bool = True  # restart workers after the ramp and before chaos (see full_phase)
    warmup: int = 40  # sequential requests before measuring, after every (re)start
    rejoin_grace_s: float = 10.0  # chaos: keep watching for the restarted worker after the load ends


QUICK = {
    "ramp_start_rps": 60.0, "ramp_factor": 2.0, "ramp_step_s": 0.5, "ramp_max_steps": 6, "fractions": [0.5, 1.0, 2.0],
    "point_s": 1.5, "transport_ramp_factor": 2.0, "transport_step_s": 0.4, "transport_max_steps": 6,
    "transport_s": 1.6, "segments": 2, "closed_loop": 100, "pingpongs": 300, "inproc_iterations": 100,
    "inproc_cold_iterations": 20, "chaos_s": 4.0, "pause_s": 0.2, "fresh_workers": False, "warmup": 15,
    "rejoin_grace_s": 1.0,
}


# ----------------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar per load run (requests scheduled) under one bar of phases."""

    def __init__(self, phases: int, enabled: bool) -> None:
        self.enabled = enabled
        self.outer: Any = None
        self.phase_s: dict[str, float] = {}  # wall time per phase, reported in meta
        self._phase, self._phase_t0 = "", time.monotonic()
        if enabled:
            from tqdm import tqdm

            self._tqdm = tqdm
            self.outer = tqdm(total=phases, desc="bench", unit="phase", position=0, file=sys.stderr, mininterval=0.5)
        self.inner: Any = None

    def phase(self, name: str) -> None:
        self._phase, self._phase_t0 = name, time.monotonic()
        if self.outer is not None:
            self.outer.set_description(f"bench: {name}")

    def phase_done(self) -> None:
        self.phase_s[self._phase] = round(time.monotonic() - self._phase_t0, 1)
        if self.outer is not None:
            self.outer.update(1)

    def run(self, label: str, expected: int) -> Callable[[int], None] | None:
        if not self.enabled:
            return None
        if self.inner is not None:
            self.inner.close()
        self.inner = self._tqdm(total=expected, desc=label, unit="req", position=1, leave=False, file=sys.stderr,
                                mininterval=0.5)
        return self.inner.update

    def note(self, text: str) -> None:
        if self.outer is not None:
            self.outer.set_postfix_str(text)

    def close(self) -> None:
        for bar in (self.inner, self.outer):
            if bar is not None:
                bar.close()


# --------------------------------------------------------------------------------------- load


def _p99(s: dict[str, Any]) -> float | None:
    lat = s["latency_us"].get("latency")
    return None if not lat or lat["p99"] is None else lat["p99"]


def _healthy(s: dict[str, Any], deadline_ms: float) -> bool:
    p99 = _p99(s)
    failed = s["error_count"] + s["not_sent_generator_late"]
    return (p99 is not None and p99 < deadline_ms * 1000
            and failed <= KNEE_MAX_ERROR_FRACTION * max(1, s["scheduled"]))


class Driver:
    """Runs open-loop steps through one AsyncClient and attaches broker counter deltas."""

    def __init__(self, client: AsyncClient, templates: Sequence[AssembleRequest], *, status_endpoint: str | None,
                 plan: Plan, progress: Progress, meta: dict[str, Any]) -> None:
        self.client = client
        self.templates = templates
        self.status_endpoint = status_endpoint
        self.plan = plan
        self.progress = progress
        self.meta = meta
        self.runs = 0
        self.raw: list[RunResult] = []

    async def _broker_stats(self) -> dict[str, int]:
        if self.status_endpoint is None:
            return {}
        st = await asyncio.to_thread(broker_status, self.status_endpoint, 1.0)
        return dict(st["stats"]) if st else {}

    async def warm(self, n: int | None = None) -> None:
        """One request at a time: warms connections and caches without a burst (a burst would
        also teach the workers' stage-cost trackers an inflated reserve)."""
        self.runs += 1
        target = ClientTarget(self.client, self.templates, tag=f"warm{self.runs}")
        for k in range(self.plan.warmup if n is None else n):
            await target(k, 2.0)

    async def run(self, label: str, rate: float, duration_s: float) -> tuple[RunResult, dict[str, int]]:
        """One open-loop run: (raw result, broker counter deltas)."""
        self.runs += 1
        before = await self._broker_stats()
        tick = self.progress.run(label, int(rate * duration_s))
        target = ClientTarget(self.client, self.templates, tag=f"{self.meta.get('mode')}-{self.runs}")
        run = await open_loop(target, rate=rate, duration_s=duration_s, deadline_ms=self.plan.deadline_ms,
                              label=label, seed=self.plan.seed * 1000 + self.runs, tick=tick, meta=self.meta)
        after = await self._broker_stats()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
                 if after.get(k, 0) != before.get(k, 0)}
        self.raw.append(run)
        return run, delta

    def summarize(self, run: RunResult, broker: dict[str, int]) -> dict[str, Any]:
        s = run.summary()
        s["broker"] = broker
        p99 = _p99(s)
        self.progress.note(f"{run.label}: goodput {s['goodput_rps']:.0f}/s p99 "
                           f"{'-' if p99 is None else f'{p99 / 1000:.1f} ms'}")
        return s

    async def step(self, label: str, rate: float, duration_s: float) -> dict[str, Any]:
        run, broker = await self.run(label, rate, duration_s)
        await asyncio.sleep(self.plan.pause_s)  # let queues drain: the next step starts clean
        return self.summarize(run, broker)

    async def closed_loop(self, n: int) -> dict[str, Any]:
        """``n`` requests one at a time (no queueing anywhere): the per-request path cost."""
        target = ClientTarget(self.client, self.templates, tag=f"closed{self.runs}")
        hs = Histograms()
        outcomes: dict[str, int] = {}
        for i in range(n):
            t0 = time.perf_counter_ns()
            reply = await target(i, self.plan.deadline_ms / 1000)
            hs.record("latency", (time.perf_counter_ns() - t0) / 1000)
            outcomes[reply.outcome] = outcomes.get(reply.outcome, 0) + 1
        return {"requests": n, "outcomes": outcomes, "latency_us": hs.summary()["latency"]}

    async def ramp(self, *, start: float, factor: float, step_s: float, max_steps: int) -> dict[str, Any]:
        """Geometric ramp until goodput stops tracking the offered rate or p99 reaches the deadline."""
        steps: list[dict[str, Any]] = []
        rate = start
        broke = False
        for _ in range(max_steps):
            s = await self.step(f"ramp {rate:.0f}/s", rate, step_s)
            steps.append(s)
            if not (_healthy(s, self.plan.deadline_ms) and s["good"] >= 0.9 * s["scheduled"]):
                broke = True
                break
            rate *= factor
        best = max(steps, key=lambda s: s["goodput_rps"])
        return {"saturation_rps": best["goodput_rps"], "reached": broke, "steps": steps}


async def transport_phase(endpoint: str, plan: Plan, progress: Progress, workers: int,
                          fp: floor.FloorProcs | None, payload: bytes) -> dict[str, Any]:
    """Ramp to saturation, then half of it. With the floor processes up, the half-saturation run
    is interleaved with the bare relay in ``plan.segments`` A/B segments at the same offered rate,
    so machine drift hits both alike."""
    c = await connected_client(endpoint)
    raw: floor.RawTarget | None = None
    zctx = None
    try:
        d = Driver(c, request_templates(seed=plan.seed), status_endpoint=endpoint, plan=plan, progress=progress,
                   meta={"mode": "transport", "workers": workers})
        await d.warm()
        closed = await d.closed_loop(plan.closed_loop)
        ramp = await d.ramp(start=plan.transport_ramp_start_rps, factor=plan.transport_ramp_factor,
                            step_s=plan.transport_step_s, max_steps=plan.transport_max_steps)
        rate = max(1.0, ramp["saturation_rps"] / 2)
        if fp is not None:
            zctx = zmq.Context()
            raw = floor.RawTarget(zctx, fp.relay_front, payload)
            await raw(-1, 5.0)
        seg_s = plan.transport_s / plan.segments
        t_runs, f_runs = [], []
        broker: dict[str, int] = {}
        for k in range(plan.segments):
            run, delta = await d.run(f"transport {rate:.0f}/s [{k + 1}/{plan.segments}]", rate, seg_s)
            t_runs.append(run)
            for key, v in delta.items():
                broker[key] = broker.get(key, 0) + v
            await asyncio.sleep(plan.pause_s / 2)
            if raw is not None:
                f_runs.append(await open_loop(
                    raw, rate=rate, duration_s=seg_s, deadline_ms=None, label=f"floor relay {rate:.0f}/s",
                    seed=plan.seed * 7 + k, meta={"mode": "floor-relay"},
                    tick=progress.run(f"floor relay {rate:.0f}/s [{k + 1}/{plan.segments}]", int(rate * seg_s))))
                await asyncio.sleep(plan.pause_s / 2)
        out: dict[str, Any] = {
            "workers": workers, "saturation_rps": ramp["saturation_rps"], "saturation_reached": ramp["reached"],
            "closed_loop": closed, "ramp": ramp["steps"],
            "half_saturation": d.summarize(merge_runs(t_runs, f"transport {rate:.0f}/s"), broker)}
        if f_runs:
            out["floor_relay_open_loop"] = merge_runs(f_runs, f"floor relay {rate:.0f}/s").summary()
        return out
    finally:
        if raw is not None:
            await raw.aclose()
        if zctx is not None:
            zctx.term()
        await c.aclose()


async def full_phase(endpoint: str, plan: Plan, progress: Progress, workers: int | None,
                     status_endpoint: str | None, after_ramp: Callable[[], None] | None = None) -> dict[str, Any]:
    """Ramp to saturation, then sweep fractions of it. ``after_ramp`` (a blocking call, run in a
    thread) restarts the workers so the sweep starts from fresh per-worker state: a worker's
    stage-cost trackers remember the ramp's overload step for hundreds of requests."""
    c = await connected_client(endpoint)
    try:
        d = Driver(c, Requests(request_templates(seed=plan.seed), new_questions=plan.new_questions),
                   status_endpoint=status_endpoint, plan=plan, progress=progress,
                   meta={"mode": "full", "workers": workers, "new_questions": plan.new_questions})
        await d.warm()
        out: dict[str, Any] = {"workers": workers}
        if plan.rates:
            rates = list(plan.rates)
            out["saturation_rps"] = None
        else:
            ramp = await d.ramp(start=plan.ramp_start_rps, factor=plan.ramp_factor, step_s=plan.ramp_step_s,
                                max_steps=plan.ramp_max_steps)
            out.update(saturation_rps=ramp["saturation_rps"], saturation_reached=ramp["reached"], ramp=ramp["steps"])
            rates = [max(1.0, f * ramp["saturation_rps"]) for f in plan.fractions]
            if after_ramp is not None:
                await asyncio.to_thread(after_ramp)
                out["workers_restarted_after_ramp"] = True
                await d.warm()
        points = []
        for k, rate in enumerate(rates):
            s = await d.step(f"{workers or 'ext'}w {rate:.0f}/s", rate, plan.point_s)
            if not plan.rates:
                s["fraction_of_saturation"] = plan.fractions[k]
            points.append(s)
        out["points"] = points
        if out.get("saturation_rps") is None:
            out["saturation_rps"] = max(p["goodput_rps"] for p in points)
        healthy = [p for p in points if _healthy(p, plan.deadline_ms)]
        out["knee_rps"] = max((p["offered_rps"] for p in healthy), default=None)
        out["peak_goodput_rps"] = max([p["goodput_rps"] for p in points]
                                      + [s["goodput_rps"] for s in out.get("ramp", [])])
        return out
    finally:
        await c.aclose()


async def chaos_phase(stack: LocalStack, plan: Plan, progress: Progress, rate: float) -> dict[str, Any]:
    c = await connected_client(stack.frontend)
    try:
        templates = Requests(request_templates(seed=plan.seed), new_questions=plan.new_questions)
        d = Driver(c, templates, status_endpoint=stack.frontend, plan=plan, progress=progress,
                   meta={"mode": "chaos"})
        await d.warm()
        tick = progress.run(f"chaos {rate:.0f}/s", int(rate * plan.chaos_s))
        report, _run = await run_chaos(stack, c, templates, rate=rate, duration_s=plan.chaos_s,
                                       deadline_ms=plan.deadline_ms, tick=tick, rejoin_grace_s=plan.rejoin_grace_s)
        report["victim"] = 0
        return report
    finally:
        await c.aclose()


# ------------------------------------------------------------------------------------- driver


def run_bench(plan: Plan, *, modes: set[str], endpoint: str | None, env: dict[str, str], out_dir: Path,
              progress: Progress, argv: list[str]) -> dict[str, Any]:
    """Run the selected phases and return the results document (see the module docstring).

    One LocalStack serves every stack phase: its workers start in transport mode when that phase
    runs, and are restarted in full mode (``stack.mode``) for the sweeps and chaos.
    """
    started = time.monotonic()
    results: dict[str, Any] = {"meta": _meta(plan, modes, endpoint, env, argv)}
    max_workers = max(plan.workers)
    own_stack = endpoint is None and bool(modes & {"transport", "full", "chaos"})
    with runner() as loop, contextlib.ExitStack() as cleanup:
        if "inproc" in modes:
            progress.phase("inproc")
            results["inproc"] = inproc.run(iterations=plan.inproc_iterations,
                                           cold_iterations=plan.inproc_cold_iterations)
            progress.phase_done()
        stack: LocalStack | None = None
        if own_stack:
            progress.phase("starting the stack")
            stack = cleanup.enter_context(started_stack(
                workers=max_workers, env=env, log_dir=out_dir / "logs", seed=bool(modes & {"full", "chaos"}),
                worker_module=TRANSPORT_WORKER if "transport" in modes else FULL_WORKER))
            progress.phase_done()
        payload = encode(request_templates(seed=plan.seed)[0])  # floor messages: a real request's size
        if "transport" in modes and stack is not None:
            progress.phase("transport" + (" + floor" if "floor" in modes else ""))
            with floor.floor_processes() if "floor" in modes else contextlib.nullcontext() as fp:
                tr = loop.run(transport_phase(stack.frontend, plan, progress, max_workers, fp, payload))
                relay = tr.pop("floor_relay_open_loop", None)
                results["transport"] = tr
                if fp is not None and relay is not None:
                    results["floor"] = {
                        "payload_bytes": len(payload), "interleaved_with_transport": True,
                        "relay_open_loop": relay,
                        "relay_pingpong_us": floor.pingpong(fp.relay_front, plan.pingpongs, payload).summary()["rtt"],
                        "pingpong_us": floor.pingpong(fp.direct, plan.pingpongs, payload).summary()["rtt"]}
            progress.phase_done()
        elif "floor" in modes:
            progress.phase("floor")
            rate = plan.floor_rate or 200.0
            results["floor"] = floor.measure(
                rate=rate, duration_s=plan.transport_s, pingpongs=plan.pingpongs, payload=payload,
                tick=progress.run(f"floor {rate:.0f}/s", int(rate * plan.transport_s)), run=loop.run)
            progress.phase_done()
        if "full" in modes and endpoint is not None:
            progress.phase("full (external)")
            results["full"] = {"sweeps": [loop.run(full_phase(endpoint, plan, progress, None, endpoint))]}
            progress.phase_done()
        if stack is not None and modes & {"full", "chaos"}:
            if stack.worker_module != FULL_WORKER:  # the transport-mode workers make way for full ones
                set_workers(stack, 0)
                stack.worker_module = FULL_WORKER
            sweeps: list[dict[str, Any]] = []
            for n in sorted(set(plan.workers)) if "full" in modes else []:
                progress.phase(f"full, {n} worker(s)")
                set_workers(stack, n)

                def fresh(n: int = n, stack: LocalStack = stack) -> None:
                    set_workers(stack, 0)
                    set_workers(stack, n)

                sweeps.append(loop.run(full_phase(stack.frontend, plan, progress, n, stack.frontend,
                                                    fresh if plan.fresh_workers else None)))
                progress.phase_done()
            if sweeps:
                results["full"] = {"sweeps": sweeps}
            if "chaos" in modes:
                progress.phase("chaos")
                if sweeps and plan.fresh_workers:
                    set_workers(stack, 0)  # the last sweep point was an overload: start fresh
                set_workers(stack, max_workers)
                sat = next((s["saturation_rps"] for s in sweeps if s["workers"] == max_workers), None)
                rate = plan.chaos_rate or (plan.chaos_fraction * sat if sat else 100.0)
                results["chaos"] = loop.run(chaos_phase(stack, plan, progress, rate))
                progress.phase_done()
    results["targets"] = targets(results, plan)
    results["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    results["meta"]["phase_s"] = dict(progress.phase_s)
    results["meta"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def _meta(plan: Plan, modes: set[str], endpoint: str | None, env: dict[str, str], argv: list[str]) -> dict[str, Any]:
    return {
        "command": " ".join(["python -m bench.run", *argv]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "modes": [m for m in MODES if m in modes],
        "endpoint": endpoint,
        "env": env,
        "plan": plan.__dict__,
    }


# ------------------------------------------------------------------------------------- targets


def _pct(s: dict[str, Any] | None, comp: str, key: str) -> float | None:
    if not s:
        return None
    h = s.get("latency_us", {}).get(comp)
    return None if not h or h.get(key) is None else float(h[key])


def _target(name: str, target: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"name": name, "target": target, "measured": measured, "met": met}


def targets(results: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """The stack's performance targets, reported (never asserted)."""
    out = []
    tr = results.get("transport", {}).get("half_saturation")
    fl = results.get("floor", {}).get("relay_open_loop")
    if tr and fl:
        for key, limit in (("p50", 1.3), ("p99", 2.0)):
            t, f = _pct(tr, "latency", key), _pct(fl, "latency", key)
            if t is not None and f:
                ratio = t / f
                out.append(_target(f"transport {key} vs floor relay {key} at half saturation", f"<= {limit}x",
                                   f"{t / 1000:.3f} ms / {f / 1000:.3f} ms = {ratio:.2f}x", ratio <= limit))
    ip = results.get("inproc")
    if ip:
        warm, cold = ip["warm"]["wall"]["p50"], ip["cold"]["wall"]["p50"]
        out.append(_target(f"inproc pipeline p50, n = {ip['n_candidates']}, warm cache", "<= 1 ms",
                           f"{warm / 1000:.3f} ms (cold cache {cold / 1000:.3f} ms)", warm <= 1000))
    for sw in results.get("full", {}).get("sweeps", []):
        pts = [p for p in sw["points"] if p.get("fraction_of_saturation") == 2.0]
        w = sw["workers"] or "ext"
        if pts:
            p = pts[0]
            frac = p["goodput_rps"] / sw["peak_goodput_rps"] if sw["peak_goodput_rps"] else 0.0
            out.append(_target(f"{w} worker(s): goodput at 2x saturation", ">= 90 % of peak",
                               f"{p['goodput_rps']:.0f}/s of peak {sw['peak_goodput_rps']:.0f}/s = {frac:.0%}",
                               frac >= 0.9))
            out.append(_target(f"{w} worker(s): replies later than deadline + 5 ms at 2x saturation", "0",
                               str(p["late_replies_after_deadline_5ms"]), p["late_replies_after_deadline_5ms"] == 0))
        late_all = sum(p["late_replies_after_deadline_5ms"] for p in sw["points"])
        out.append(_target(f"{w} worker(s): replies later than deadline + 5 ms, whole sweep", "0", str(late_all),
                           late_all == 0))
    ch = results.get("chaos")
    if ch:
        out.append(_target("chaos: sent == responses + typed errors", "0 lost",
                           f"sent {ch['sent']} = {ch['responses']} responses + {ch['typed_errors']} typed errors "
                           f"(lost {ch['lost']}, untyped {ch['untyped_errors']})", ch["nothing_lost"]))
        out.append(_target("chaos: replies later than deadline + 5 ms", "0",
                           str(ch["late_replies_after_deadline_5ms"]), ch["late_replies_after_deadline_5ms"] == 0))
    return out


# ----------------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_plan(args: argparse.Namespace) -> Plan:
    plan = Plan()
    if args.quick:
        plan = replace(plan, **QUICK)
        plan.workers = [max(plan.workers)]
    overrides: dict[str, Any] = {}
    if args.no_fresh_workers:
        overrides["fresh_workers"] = False
    if args.new_questions:
        overrides["new_questions"] = True
    if args.deadline_ms is not None:
        overrides["deadline_ms"] = args.deadline_ms
    if args.workers:
        overrides["workers"] = [int(x) for x in args.workers.split(",")]
    if args.rates:
        overrides["rates"] = _floats(args.rates)
    if args.fractions:
        overrides["fractions"] = _floats(args.fractions)
    for flag, name in (("duration", "point_s"), ("ramp_step", "ramp_step_s"), ("ramp_start", "ramp_start_rps"),
                       ("transport_duration", "transport_s"), ("floor_rate", "floor_rate"),
                       ("chaos_duration", "chaos_s"), ("chaos_rate", "chaos_rate"), ("seed", "seed"),
                       ("inproc_iterations", "inproc_iterations"), ("pingpongs", "pingpongs")):
        value = getattr(args, flag)
        if value is not None:
            overrides[name] = value
    return replace(plan, **overrides)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short settings (< 60 s), max worker count only")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--endpoint", help="an already running broker frontend (full mode only; no stack is started)")
    ap.add_argument("--deadline-ms", type=float, help="client timeout per request (default 100)")
    ap.add_argument("--workers", help="worker counts for the full sweep, e.g. 1,2 (default 1..usable CPUs)")
    ap.add_argument("--rates", help="explicit offered rates (req/s) for the full sweep; skips the ramp")
    ap.add_argument("--fractions", help="sweep points as fractions of saturation (default 0.25,...,2)")
    ap.add_argument("--duration", type=float, help="seconds per sweep point (default 4)")
    ap.add_argument("--ramp-step", type=float, help="seconds per saturation-ramp step (default 1.5)")
    ap.add_argument("--ramp-start", type=float, help="first ramp rate, req/s (default 40)")
    ap.add_argument("--transport-duration", type=float, help="seconds of the transport and floor runs (default 5)")
    ap.add_argument("--floor-rate", type=float, help="floor relay rate when run without the transport phase")
    ap.add_argument("--chaos-duration", type=float, help="seconds of the chaos run (default 10)")
    ap.add_argument("--chaos-rate", type=float, help="chaos offered rate (default half the saturation)")
    ap.add_argument("--inproc-iterations", type=int, help="warm-cache inproc iterations (default 300)")
    ap.add_argument("--pingpongs", type=int, help="closed-loop floor round trips (default 2000)")
    ap.add_argument("--seed", type=int, help="arrival and request seed (default 9)")
    ap.add_argument("--new-questions", action="store_true",
                    help="full and chaos modes: every request a question never sent before, so the memory "
                         "service embeds each one (as behind a proxy); by default a few dozen questions repeat")
    ap.add_argument("--no-fresh-workers", action="store_true",
                    help="keep the workers the ramp overloaded for the sweep (by default they are restarted)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra IBEX_* for the stack")
    ap.add_argument("--out", type=Path, default=OUT, help="output directory (default bench/out)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    unknown = modes - set(MODES)
    if unknown:
        print(f"unknown mode(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.endpoint:
        dropped = modes & {"transport", "chaos"}
        if dropped:
            print(f"--endpoint: skipping {', '.join(sorted(dropped))} (they need a stack the bench owns)",
                  file=sys.stderr)
        modes -= dropped
    env = dict(kv.split("=", 1) for kv in args.env)
    plan = build_plan(args)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    n_phases = (len(modes & {"inproc", "transport", "chaos"}) + int("floor" in modes and "transport" not in modes)
                + (int("full" in modes) if args.endpoint else len(set(plan.workers)) * int("full" in modes))
                + int(not args.endpoint and bool(modes & {"transport", "full", "chaos"})))
    progress = Progress(n_phases, enabled=not args.no_progress)
    try:
        results = run_bench(plan, modes=modes, endpoint=args.endpoint, env=env, out_dir=out_dir,
                            progress=progress, argv=argv)
    finally:
        progress.close()
    from bench import report

    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plots = [] if args.no_plots else report.plots(results, out_dir)
    md = report.markdown(results, plots)
    (out_dir / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
