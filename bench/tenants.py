"""``python -m bench.tenants [--quick] [--rounds N] [--capacity R]``: what one org's flood does to
another org's assemblies, through the real stack.

The stack is ``LocalStack`` (embedded Redis, the memory service, the broker and 2 pinned workers)
with CURVE on: a keys file with one client key per org, made the way ``ibex-context keys``
makes them (``shared.security.auth``), and an ops key for the broker's STATUS. The demo data is
seeded for both orgs. The victim is ``acme``, the attacker ``globex``.

1. Capacity: a short ramp of the victim's own kind of request (a new question every call, so the
   memory service embeds each one; deadline 100 ms); the stack's capacity is the highest rate with
   >= 90 % undegraded on-time replies and p99 under the deadline (``bench.peers``' saturation);
   when no rate meets it (a machine busy with other work), the rate with the most undegraded
   on-time replies a second, and the report says so. ``--capacity`` skips the ramp.
2. The victim sends at ``--victim-share`` (10 %) of that capacity, open loop (Poisson), a new
   question every call, deadline 100 ms, through the real ``AsyncClient`` with acme's key.
3. Rows: per attack, one attack-off and one attack-on window of the victim, in every round
   (``--rounds``; the rows rotate and off/on swap order each round, so drift hits both alike):

   * assemblies: globex's new-question assemblies at 2x, 5x and 10x capacity, with 1 s and with
     100 ms deadlines;
   * memory writes with globex's token: large (60,000 characters, 16 writers back to back) and
     tiny (300 characters, open loop at ``--tiny-rate``);
   * usage reports (``AsyncClient.report_usage``) and compaction summaries
     (``AsyncClient.report_summary``, ``as_memory``) at capped rates;
   * heavy assemblies: conversations of ``heavy_chars`` (400,000) characters at ``heavy_rate``
     (40/s), repeated questions, 1 s deadline: what presses on the workers' CPU, not on the memory
     service.

   The attack starts ``lead_s`` before the victim's window and ends after it. After every window
   the run waits until the memory service and Redis are idle (``bench.lib.stack.settle``), so no
   window starts against work left over from the last.

The table per row: the victim's share of undegraded on-time replies (off and on), p50/p99 of every
request sent (a refusal is fast, a deadline miss is 100 ms: both are in it), OVERLOADED refusals,
late outcomes (DEADLINE_EXCEEDED, or a reply after the deadline), the off-window p99 and the
delta; the attacker's offered and achieved send rate, what it was served (on-time replies,
undegraded ones, 201 writes, reports forwarded by the broker) and its generator's CPU.

The attacker's generator is kept small and reported (``bench.tenant_attack``): one process,
``os.nice(19)`` before it opens a socket, open loop at a capped rate (``--attack-rate-cap``)
with pipelined async sends on one event loop (no send waits for a reply), its client library's
adaptive throttle off (``client.throttle``: an attacker would not throttle itself), and its own CPU
seconds per window are in the table (``gen CPU``), beside the victim generator's, so a reader can
see how much of the 2 cores the load itself took. On a shared box the low priority means the
attacker may fall behind its offered rate: the achieved send rate is printed next to it.

``--baseline CHECKOUT``: that checkout's broker and workers run beside this stack's, on the same
Redis and memory service with the same keys, as the arm ``base`` (with ``--baseline-memory``, on a
memory service of that checkout's own, on the same Redis); every row then has four windows
a round (this stack's off and on, the baseline's off and on, the arms' order rotating each round),
and the report has one table per arm. The victim and the attacker drive both arms with this
checkout's client, so only the serving differs.

Outputs: the Markdown table on stdout; with ``--json`` also ``tenants.json`` and ``tenants.md``
in ``--out`` (``bench/out``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.percentiles import percentile
from bench.lib.stack import (
    OUT,
    REPO,
    child_env,
    git_commit,
    new_stack,
    runner,
    settle,
    start_baseline,
    start_seeded,
)
from bench.loadgen import NOT_SENT, OK, ClientTarget, RunResult, merge_runs, open_loop
from bench.tenant_attack import READY, AttackConfig, org_templates
from bench.tenant_report import markdown
from bench.workload import Requests
from ibex_context.client.client import AsyncClient
from ibex_context.ops.local import LocalStack
from ibex_context.shared.security import auth

VICTIM, ATTACKER, OPS_ORG = "acme", "globex", "ibex-ops"
ARM, BASE = "ibex", "base"  # this checkout's stack, and the --baseline checkout's beside it
RAMP = [10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 100.0, 125.0, 150.0, 200.0]
QUICK: dict[str, Any] = {"ramp_rates": [20.0, 40.0], "ramp_s": 1.0, "window_s": 1.5, "lead_s": 0.3, "rounds": 1,
                         "attack_rate_cap": 400.0, "tiny_rate": 100.0, "usage_rate": 600.0, "summary_rate": 100.0,
                         "settle_max_s": 5.0, "victim_floor_rps": 8.0, "heavy_rate": 10.0, "heavy_chars": 100_000}


@dataclass
class TenantPlan:
    deadline_ms: float = 100.0
    victim_share: float = 0.10
    victim_floor_rps: float = 2.0  # never fewer victim requests a second than this (a tiny capacity)
    capacity: float | None = None  # req/s; None: measured by the ramp
    ramp_rates: list[float] = field(default_factory=lambda: list(RAMP))
    ramp_s: float = 3.0
    window_s: float = 10.0
    lead_s: float = 1.0  # the attack runs this long before the victim's window opens
    tail_s: float = 0.2  # ... and this long after it closes
    rounds: int = 3
    factors: tuple[float, ...] = (2.0, 5.0, 10.0)
    attack_deadlines_ms: tuple[float, ...] = (1000.0, 100.0)
    attack_rate_cap: float = 2000.0  # the assembly flood never offers more than this
    large_chars: int = 60_000
    large_concurrency: int = 16
    tiny_chars: int = 300
    tiny_rate: float = 400.0
    usage_rate: float = 3000.0
    summary_rate: float = 400.0
    summary_chars: int = 4000
    heavy_chars: int = 400_000  # earlier turns of each heavy assembly
    heavy_rate: float = 40.0
    settle_max_s: float = 30.0
    workers: int = 2
    seed: int = 23
    rows: tuple[str, ...] | None = None  # a subset of row keys; None: every row
    baseline: str | None = None  # a checkout run beside as the arm "base" (module doc)
    baseline_memory: bool = False  # the baseline arm runs that checkout's memory service too (module doc)


@dataclass(frozen=True)
class Row:
    key: str
    title: str
    cmd: dict[str, Any]


def rows_of(plan: TenantPlan, capacity: float) -> list[Row]:
    rows = []
    for d in plan.attack_deadlines_ms:
        for f in plan.factors:
            rate = min(f * capacity, plan.attack_rate_cap)
            capped = " (capped)" if rate < f * capacity else ""
            rows.append(Row(f"assemble-{f:g}x-{d:g}ms", f"assemblies {f:g}x capacity, {d:g} ms deadline{capped}",
                            {"kind": "assemble", "rate": round(rate, 1), "deadline_ms": d}))
    rows += [
        Row("writes-large", f"memory writes {plan.large_chars:,} chars, {plan.large_concurrency} concurrent",
            {"kind": "writes", "chars": plan.large_chars, "concurrency": plan.large_concurrency}),
        Row("writes-tiny", f"memory writes {plan.tiny_chars} chars at {plan.tiny_rate:g}/s",
            {"kind": "writes", "chars": plan.tiny_chars, "rate": plan.tiny_rate}),
        Row("usage", f"usage reports at {plan.usage_rate:g}/s", {"kind": "usage", "rate": plan.usage_rate}),
        Row("summaries", f"summaries ({plan.summary_chars} chars, as memory) at {plan.summary_rate:g}/s",
            {"kind": "summaries", "rate": plan.summary_rate, "summary_chars": plan.summary_chars}),
        Row("assemble-heavy", f"assemblies of {plan.heavy_chars:,}-char conversations at {plan.heavy_rate:g}/s, "
                              "1000 ms deadline",
            {"kind": "heavy", "rate": plan.heavy_rate, "chars": plan.heavy_chars, "deadline_ms": 1000.0}),
    ]
    return [r for r in rows if plan.rows is None or r.key in plan.rows]


# ----------------------------------------------------------------------------- keys and stack


def make_keys(d: Path) -> dict[str, Path]:
    """Broker, worker, one client key per org and an ops key, registered in ``d/keys.json``."""
    d.mkdir(parents=True, exist_ok=True)
    for name in ("broker", "worker", "victim", "attacker", "ops"):
        if not (d / f"{name}.key").exists():
            auth.write_keypair(d, name)
    kf = d / "keys.json"
    kf.unlink(missing_ok=True)
    for name, org in (("victim", VICTIM), ("attacker", ATTACKER), ("ops", OPS_ORG)):
        auth.register(kf, public_key=(d / f"{name}.pub").read_bytes().strip(), role="client", name=name,
                      org_id=org, agents=["*"])
    auth.register(kf, public_key=(d / "worker.pub").read_bytes().strip(), role="worker", name="worker")
    return {"dir": d, "keys": kf}


def curve(keys: dict[str, Path], name: str) -> Any:
    d = keys["dir"]
    return auth.curve_client(auth.load_keypair(d / f"{name}.key"), auth.load_public_key(str(d / "broker.pub")))


@contextlib.contextmanager
def curve_stack(plan: TenantPlan, log_dir: Path) -> Iterator[tuple[dict[str, LocalStack], dict[str, Path]]]:
    """The stack per arm (``ARM``, and ``BASE`` with ``--baseline``: its broker and workers on the
    first one's Redis and memory service, with the same keys) and the keys."""
    log_dir.mkdir(parents=True, exist_ok=True)
    keys = make_keys(log_dir / "keys")
    d = keys["dir"]
    env = {"IBEX_AUTH_KEYS_FILE": str(keys["keys"]), "IBEX_BROKER_KEY_FILE": str(d / "broker.key"),
           "IBEX_BROKER_PUBLIC_KEY": str(d / "broker.pub"), "IBEX_WORKER_KEY_FILE": str(d / "worker.key")}
    stack = new_stack(workers=plan.workers, log_dir=log_dir, env=env, status_socket=curve(keys, "ops"))
    stacks = {ARM: stack}
    try:
        start_seeded(stack)
        if plan.baseline is not None:
            stacks[BASE] = start_baseline(stack, plan.baseline, log_dir / "base", workers=plan.workers, env=env,
                                          status_socket=curve(keys, "ops"), own_memory=plan.baseline_memory)
        yield stacks, keys
    finally:
        for st in reversed(stacks.values()):
            st.stop()


# ----------------------------------------------------------------------------------- the attacker


class AttackerProc:
    """``bench.tenant_attack`` as a child process: one JSON command a line, one JSON result a line."""

    def __init__(self, proc: asyncio.subprocess.Process, pid: int) -> None:
        self.proc, self.pid = proc, pid

    async def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the attacker exited (code {await self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out


@contextlib.asynccontextmanager
async def attacker(stack: LocalStack, keys: dict[str, Path], log_dir: Path, seed: int,
                   name: str = "attacker", frontend: str | None = None) -> AsyncIterator[AttackerProc]:
    """The attacker process, run with ``stack``'s environment (this checkout's client) against
    ``frontend`` (default: ``stack``'s)."""
    cfg = AttackConfig(frontend=frontend or stack.frontend, key_file=str(keys["dir"] / "attacker.key"),
                       broker_public=str(keys["dir"] / "broker.pub"), memory_url=stack.memory_url,
                       memory_secret=stack.secret, org=ATTACKER, seed=seed)
    log = await asyncio.to_thread(open, log_dir / f"{name}.log", "ab")
    with log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.tenant_attack", json.dumps(asdict(cfg)), cwd=REPO, env=child_env(stack.env()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        ready = json.loads(line) if line.startswith(b"{") else {}
        if ready.get("ready") != READY:
            raise RuntimeError(f"the attacker did not start: {line!r}; see {log_dir / 'attacker.log'}")
        yield AttackerProc(proc, int(ready["pid"]))
    finally:
        if proc.returncode is None:
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.write(b'{"kind": "quit"}\n')
                await proc.stdin.drain()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# ----------------------------------------------------------------------------------- measuring


def backend_pids(stack: LocalStack) -> list[int]:
    pids = [stack.memory.pid] if stack.memory is not None else []
    if stack.embedded is not None and stack.embedded.pid is not None:
        pids.append(stack.embedded.pid)
    return pids


def _counters(status: dict[str, Any] | None) -> collections.Counter[str]:
    """The broker's counters plus every worker's (summed), from one STATUS answer."""
    out: collections.Counter[str] = collections.Counter()
    if not status:
        return out
    out.update({k: v for k, v in status.get("stats", {}).items() if isinstance(v, int | float)})
    for w in status.get("workers", {}).values():
        out.update({f"worker.{k}": v for k, v in (w.get("stats") or {}).items() if isinstance(v, int | float)})
    return out


@dataclass
class Arm:
    """One stack under test: its victim client and its attacker process."""

    stack: LocalStack
    victim: ClientTarget
    attack: AttackerProc


@dataclass
class Bench:
    plan: TenantPlan
    arms: dict[str, Arm]
    windows: int = 0

    @property
    def stack(self) -> LocalStack:
        return self.arms[ARM].stack

    async def victim_run(self, rate: float, duration_s: float, label: str, arm: str = ARM) -> RunResult:
        self.windows += 1
        return await open_loop(self.arms[arm].victim, rate=rate, duration_s=duration_s,
                               deadline_ms=self.plan.deadline_ms, label=label,
                               seed=self.plan.seed * 10_000 + self.windows)

    async def settle(self) -> float:
        pids = {pid for arm in self.arms.values() for pid in backend_pids(arm.stack)}
        return await settle(sorted(pids), self.plan.settle_max_s)

    async def window(self, row: Row, on: bool, rate: float, arm: str = ARM) -> dict[str, Any]:
        """One victim window at ``rate`` on ``arm``, with ``row``'s attack on the same arm running
        around it when ``on``."""
        plan, a = self.plan, self.arms[arm]
        before = _counters(await asyncio.to_thread(a.stack.status, 1.0))
        attack: asyncio.Task[dict[str, Any]] | None = None
        if on:
            cmd = {**row.cmd, "duration_s": plan.lead_s + plan.window_s + plan.tail_s}
            attack = asyncio.create_task(a.attack.run(cmd))
            await asyncio.sleep(plan.lead_s)
        run = await self.victim_run(rate, plan.window_s, f"{arm} {row.key} {'on' if on else 'off'}", arm)
        result = await attack if attack is not None else None
        settle_s = await self.settle()
        after = _counters(await asyncio.to_thread(a.stack.status, 1.0))
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        return {"run": run, "attack": result, "settle_s": settle_s, "counters": delta}


def classify(run: RunResult) -> dict[str, int]:
    """Every scheduled victim request in exactly one class (they add up to ``scheduled``)."""
    limit = int(run.deadline_ms * 1e6) if run.deadline_ms is not None else None
    out = collections.Counter({"undegraded_on_time": 0, "degraded_on_time": 0, "refused": 0, "late": 0,
                               "not_sent": 0, "other_error": 0})
    for s in run.samples:
        o = s.reply.outcome
        if o == OK and (limit is None or s.latency_ns <= limit):
            out["degraded_on_time" if s.reply.degraded else "undegraded_on_time"] += 1
        elif o == OK or o == "DEADLINE_EXCEEDED":
            out["late"] += 1
        elif o == "OVERLOADED":
            out["refused"] += 1
        elif o == NOT_SENT:
            out["not_sent"] += 1
        else:
            out["other_error"] += 1
    return dict(out)


def healthy(run: RunResult, deadline_ms: float) -> tuple[bool, dict[str, Any]]:
    """``bench.peers``' saturation rule: >= 90 % undegraded on time and p99 under the deadline."""
    c = classify(run)
    lat = [s.latency_ns / 1e6 for s in run.samples if s.reply.outcome != NOT_SENT]
    p99 = percentile(lat, 99) if lat else None
    share = c["undegraded_on_time"] / max(1, len(run.samples))
    point = {"offered_rps": run.offered_rps, "scheduled": len(run.samples), "classes": c,
             "undegraded_share": round(share, 4), "p99_ms": None if p99 is None else round(p99, 2)}
    return share >= 0.9 and p99 is not None and p99 < deadline_ms, point


STAGES = ("queue_wait", "worker_wait", "retrieval", "total")  # of a reply's timings_us, in the order they run


def _stages(samples: list[Any]) -> dict[str, list[float]]:
    """p50 and p99 (ms) of each stage over the replies that carry timings, and of ``outside``:
    what the request spent beyond the worker's ``total`` (client, sockets, the broker's hops)."""
    out: dict[str, list[float]] = {}
    timed = [s for s in samples if s.reply.timings_us]
    for stage in (*STAGES, "outside"):
        if stage == "outside":
            values = [s.latency_ns / 1e6 - s.reply.timings_us["total"] / 1e3 for s in timed
                      if "total" in s.reply.timings_us]
        else:
            values = [s.reply.timings_us[stage] / 1e3 for s in timed if stage in s.reply.timings_us]
        if values:
            out[stage] = [round(percentile(values, 50), 2), round(percentile(values, 99), 2)]
    return out


def _victim(ws: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """The victim's side of one row's off (or on) windows, merged over the rounds."""
    run = merge_runs([w["run"] for w in ws], label)
    c = classify(run)
    n = len(run.samples)
    lat = [s.latency_ns / 1e6 for s in run.samples if s.reply.outcome != NOT_SENT]
    counters: collections.Counter[str] = collections.Counter()
    for w in ws:
        counters.update(w["counters"])
    return {"windows": len(ws), "scheduled": n, "classes": c,
            "undegraded_share": round(c["undegraded_on_time"] / n, 4) if n else None,
            "on_time_share": round((c["undegraded_on_time"] + c["degraded_on_time"]) / n, 4) if n else None,
            "p50_ms": round(percentile(lat, 50), 2) if lat else None,
            "p99_ms": round(percentile(lat, 99), 2) if lat else None,
            "degraded_reasons": dict(collections.Counter(r for s in run.samples if s.reply.outcome in (OK, "OVERLOADED")
                                                         for r in s.reply.degraded_reasons).most_common(6)),
            "stages_ms": _stages(run.samples),
            "generator_cpu_s": [round(w["run"].gen_cpu_s, 3) for w in ws],
            "settle_s": max((w["settle_s"] for w in ws), default=0.0), "counters": dict(counters)}


# What the broker or the workers count as the attacker served, for floods that get no reply.
SERVED_COUNTER = {"usage": "usage_forwarded", "summaries": "summary_forwarded"}


def _attacker(row: Row, ws: list[dict[str, Any]], counters: dict[str, Any]) -> dict[str, Any]:
    results = [w["attack"] for w in ws if w["attack"] is not None]
    errors = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    seconds = sum(r["duration_s"] for r in results)
    outcomes: collections.Counter[str] = collections.Counter()
    for r in results:
        outcomes.update(r.get("outcomes") or r.get("client_stats") or {})
    if row.cmd["kind"] in SERVED_COUNTER:  # what became of the reports: the broker's and the workers' counts
        prefix = SERVED_COUNTER[row.cmd["kind"]].split("_")[0] + "_"
        outcomes.update({f"stack.{k}": int(v) for k, v in counters.items()
                         if k.startswith((prefix, f"worker.{prefix}"))})
    sent = sum(r["sent"] for r in results)
    skipped = sum(r.get("skipped_inflight_cap", 0) for r in results)  # due but not made: the in-flight cap
    if row.cmd["kind"] in SERVED_COUNTER:
        served: int | None = int(counters.get(SERVED_COUNTER[row.cmd["kind"]], 0))
    else:
        served = sum(r["served"] for r in results)
    undegraded = sum(r["undegraded"] for r in results) if row.cmd["kind"] in ("assemble", "heavy") else None
    cpu = [r["cpu_s"] for r in results]
    return {"windows": len(results), "seconds": round(seconds, 2), "offered_rps": row.cmd.get("rate"),
            "concurrency": row.cmd.get("concurrency"), "sent": sent, "skipped_inflight_cap": skipped,
            "sent_rps": round(sent / seconds, 1) if seconds else None, "served": served,
            "served_rps": round(served / seconds, 1) if seconds and served is not None else None,
            "undegraded": undegraded,
            "undegraded_rps": round(undegraded / seconds, 1) if seconds and undegraded is not None else None,
            "outcomes": dict(outcomes), "generator_cpu_s": cpu,
            "generator_cpu_share": round(sum(cpu) / seconds, 3) if seconds else None, "errors": errors}


def summarize_row(row: Row, windows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    off, on = _victim(windows["off"], f"{row.key} off"), _victim(windows["on"], f"{row.key} on")
    delta = None if off["p99_ms"] is None or on["p99_ms"] is None else round(on["p99_ms"] - off["p99_ms"], 2)
    return {"key": row.key, "title": row.title, "attack_cmd": row.cmd, "off": off, "on": on, "p99_delta_ms": delta,
            "attacker": _attacker(row, windows["on"], on["counters"])}


async def measure_capacity(b: Bench) -> tuple[float, list[dict[str, Any]], bool]:
    """The ramp: (capacity, its points, whether a point met the saturation rule). It ends after the
    first unhealthy point above a healthy one. When none is healthy (a machine busy with other
    work), the capacity is the rate of the undegraded peak (most undegraded on-time replies a
    second), and the ramp ends two points past that peak."""
    points: list[dict[str, Any]] = []
    best: float | None = None
    peak_rate, peak_rps, past_peak = b.plan.ramp_rates[0], -1.0, 0
    for rate in b.plan.ramp_rates:
        run = await b.victim_run(rate, b.plan.ramp_s, f"ramp {rate:g}/s")
        ok, point = healthy(run, b.plan.deadline_ms)
        point["settle_s"] = await b.settle()
        point["healthy"] = ok
        point["undegraded_rps"] = round(point["classes"]["undegraded_on_time"] / b.plan.ramp_s, 2)
        points.append(point)
        print(f"  ramp {rate:g}/s: {point['undegraded_share']:.0%} undegraded on time, p99 {point['p99_ms']} ms",
              file=sys.stderr, flush=True)
        if point["undegraded_rps"] > peak_rps:
            peak_rate, peak_rps, past_peak = rate, point["undegraded_rps"], 0
        else:
            past_peak += 1
        if ok:
            best = rate
        elif best is not None or past_peak >= 2:
            break
    return (best if best is not None else peak_rate), points, best is not None


async def measure(plan: TenantPlan, stacks: dict[str, LocalStack], keys: dict[str, Path],
                  log_dir: Path) -> dict[str, Any]:
    templates = Requests(org_templates(VICTIM, plan.seed), new_questions=True)
    out: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as ctx:
        # The attackers start (an interpreter each, then a connect and an assembly) while the
        # victims connect and warm up; nothing is measured before both are done.
        starting = {name: asyncio.create_task(ctx.enter_async_context(attacker(
            stacks[ARM], keys, log_dir, plan.seed, "attacker" if name == ARM else f"attacker-{name}",
            frontend=st.frontend))) for name, st in stacks.items()}
        try:
            victims: dict[str, ClientTarget] = {}
            for name, st in stacks.items():
                client = AsyncClient(st.frontend, configure_socket=curve(keys, "victim"))
                ctx.push_async_callback(client.aclose)
                await client.wait_connected(10.0)
                victims[name] = ClientTarget(client, templates, tag=f"victim-{name}")
                for k in range(10):  # warm-up: the workers' and the memory service's first calls
                    await victims[name](50_000_000 + 100 * len(name) + k, 2.0)
        finally:  # every attacker that started is in ctx before anything can leave this block
            await asyncio.gather(*starting.values(), return_exceptions=True)
        arms = {name: Arm(st, victims[name], starting[name].result()) for name, st in stacks.items()}
        out["attacker_nice"] = os.getpriority(os.PRIO_PROCESS, arms[ARM].attack.pid)
        b = Bench(plan, arms)
        if plan.capacity is None:
            capacity, ramp, found = await measure_capacity(b)
            out["ramp"] = {"points": ramp, "found": found}
        else:
            capacity = plan.capacity
        rate = max(plan.victim_floor_rps, plan.victim_share * capacity)
        out.update(capacity_rps=capacity, victim_rps=round(rate, 2))
        rows = rows_of(plan, capacity)
        windows = {name: {r.key: {"off": [], "on": []} for r in rows} for name in arms}
        names = list(arms)
        for rnd in range(plan.rounds):
            shift = rnd % len(rows)
            for row in rows[shift:] + rows[:shift]:
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                        w = await b.window(row, on, rate, name)
                        windows[name][row.key]["on" if on else "off"].append(w)
                        print(f"  round {rnd + 1}/{plan.rounds} {name} {row.key} {'on ' if on else 'off'}: "
                              f"{classify(w['run'])}", file=sys.stderr, flush=True)
        out["rows"] = [summarize_row(r, windows[ARM][r.key]) for r in rows]
        if BASE in arms:
            out["baseline_rows"] = [summarize_row(r, windows[BASE][r.key]) for r in rows]
    return out


def run(plan: TenantPlan, out_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"meta": {"started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                        "commit": git_commit(), "plan": asdict(plan), "cpus": os.cpu_count(),
                                        "loadavg_start": os.getloadavg()[0]}}
    t0 = time.monotonic()
    log_dir = out_dir / "tenant-logs"
    with curve_stack(plan, log_dir) as (stacks, keys), runner() as loop:
        results.update(loop.run(measure(plan, stacks, keys, log_dir)))
    results["meta"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    results["meta"]["loadavg_end"] = os.getloadavg()[0]  # other work on the machine (1 min average)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (one round, short windows): under 2 minutes")
    ap.add_argument("--rounds", type=int, help="off/on window pairs per row (default 3)")
    ap.add_argument("--capacity", type=float, help="the stack's capacity in req/s: skips the ramp")
    ap.add_argument("--window", type=float, help="seconds per victim window")
    ap.add_argument("--victim-share", type=float, help="the victim's rate as a share of capacity (default 0.1)")
    ap.add_argument("--attack-rate-cap", type=float, help="the assembly flood's highest offered rate, req/s")
    ap.add_argument("--tiny-rate", type=float, help="tiny memory writes a second")
    ap.add_argument("--rows", help="comma-separated row keys (assemble-2x-1000ms, writes-large, usage, ...)")
    ap.add_argument("--baseline", type=Path,
                    help="another checkout of this project (e.g. a git worktree of main), its broker and workers run "
                         "beside as the arm 'base' in the same rounds (module doc)")
    ap.add_argument("--baseline-memory", action="store_true",
                    help="the baseline arm also runs that checkout's memory service, on the same Redis, so a change "
                         "in the memory service is compared too")
    ap.add_argument("--json", action="store_true", help="also write tenants.json and tenants.md in --out")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    plan = TenantPlan(**(QUICK if args.quick else {}))
    for name in ("rounds", "capacity", "victim_share", "attack_rate_cap", "tiny_rate"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    if args.window is not None:
        plan.window_s = args.window
    if args.rows:
        plan.rows = tuple(args.rows.split(","))
    if args.baseline:
        plan.baseline = str(args.baseline.resolve())
        plan.baseline_memory = args.baseline_memory
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(plan, args.out)
    md = markdown(results)
    if args.json:
        (args.out / "tenants.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        (args.out / "tenants.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
