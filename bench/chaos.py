"""Chaos under steady load: kill -9 one worker, restart it, account for every request.

The open-loop generator runs at a steady rate; at ``kill_at`` of the run worker ``victim`` gets
SIGKILL, at ``restart_at`` a fresh worker process takes its slot. Every request must end in a
response or a typed error (sent == responses + typed errors); the lateness distribution (observed
latency minus deadline, every sent request) shows whether anything was handed back late.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.lib.percentiles import percentiles
from bench.loadgen import ClientTarget, RunResult, open_loop
from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack, broker_status
from ibex_context.shared.wire.models import AssembleRequest


def _stats(endpoint: str) -> dict[str, int]:
    st = broker_status(endpoint, 1.0)
    return dict(st["stats"]) if st else {}


async def run_chaos(stack: LocalStack, client: AsyncClient, templates: Sequence[AssembleRequest], *,
                    rate: float, duration_s: float, deadline_ms: float, victim: int = 0,
                    kill_at: float = 0.3, restart_at: float = 0.5, seed: int = 8, rejoin_grace_s: float = 10.0,
                    tick: Callable[[int], None] | None = None) -> tuple[dict[str, Any], RunResult]:
    """Run the chaos scenario on a started, seeded stack; returns (report, raw run).

    The restarted worker's return to the broker is watched until ``rejoin_grace_s`` after the
    load ends (``events_s.rejoined_s`` is missing if it was not seen by then)."""
    before = await asyncio.to_thread(_stats, stack.frontend)
    events: dict[str, float] = {}
    t0 = time.monotonic()

    async def fault() -> None:
        await asyncio.sleep(kill_at * duration_s)
        events["killed_s"] = time.monotonic() - t0
        await asyncio.to_thread(stack.signal_worker, victim, signal.SIGKILL)
        await asyncio.sleep(max(0.0, restart_at * duration_s - (time.monotonic() - t0)))
        events["restarted_s"] = time.monotonic() - t0
        stack.workers[victim] = stack.start_worker(victim)
        while time.monotonic() - t0 < duration_s + rejoin_grace_s:
            st = await asyncio.to_thread(broker_status, stack.frontend, 0.5)
            if st is not None and len(st["workers"]) >= stack.n_workers:
                events["rejoined_s"] = time.monotonic() - t0
                return
            await asyncio.sleep(0.05)

    target = ClientTarget(client, templates, tag=f"chaos{seed}")
    fault_task = asyncio.create_task(fault())
    try:
        run = await open_loop(target, rate=rate, duration_s=duration_s, deadline_ms=deadline_ms, label="chaos",
                              seed=seed, tick=tick, meta={"mode": "chaos", "workers": stack.n_workers},
                              start_delay_s=0.0)
    finally:
        await fault_task
    after = await asyncio.to_thread(_stats, stack.frontend)
    return chaos_report(run, events, before, after), run


def chaos_report(run: RunResult, events: dict[str, float], before: dict[str, int],
                 after: dict[str, int]) -> dict[str, Any]:
    s = run.summary()
    typed = sum(v for k, v in s["errors"].items() if not k.startswith("EXC:") and k != "HUNG")
    lost = s["sent"] - s["responses"] - typed
    late = run.lateness_ms()
    pcts = (0, 50, 90, 99, 99.9, 100)
    lateness = {k: round(v, 3) for k, v in percentiles(late, pcts).items()} if late.size else {}
    # Outcomes over time in 0.5 s buckets by scheduled send time (plots, and to see the fault window).
    buckets: dict[int, dict[str, int]] = {}
    for smp in run.samples:
        b = buckets.setdefault(int(smp.scheduled_ns // 500_000_000), {})
        b[smp.reply.outcome] = b.get(smp.reply.outcome, 0) + 1
    return {
        **{k: s[k] for k in ("offered_rps", "duration_s", "deadline_ms", "scheduled", "sent", "responses",
                             "degraded", "errors", "untyped_errors", "good", "goodput_rps",
                             "late_replies_after_deadline_5ms", "late_outcomes_after_deadline_5ms",
                             "workers_seen", "generator_cpu_frac")},
        "not_sent_generator_late": s["not_sent_generator_late"],
        "typed_errors": typed,
        "lost": lost,
        "nothing_lost": lost == 0 and s["untyped_errors"] == 0,
        "events_s": {k: round(v, 3) for k, v in events.items()},
        "lateness_ms": lateness,
        "latency_us": s["latency_us"],
        "broker_stats_delta": {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
                               if after.get(k, 0) != before.get(k, 0)},
        "timeline_0_5s": [{"t_s": k / 2, **v} for k, v in sorted(buckets.items())],
    }

