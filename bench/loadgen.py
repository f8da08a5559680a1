"""Open-loop load generation: Poisson arrivals against absolute send times.

Arrival times are drawn up front (exponential gaps at the offered rate) and each request is sent
by its own task at its scheduled instant, whatever happened to earlier requests: a slow server
cannot slow the generator, so there is no coordinated omission. Latency is measured from the
*scheduled* send time; how late the generator itself was (``send_lag``) is recorded separately.

The request's deadline is absolute from the scheduled time too: the client is given
``timeout = deadline - send_lag``, so a late generator shortens the request's budget exactly as
a late caller would. A request whose whole budget was eaten by generator lag is not sent and is
counted as ``NOT_SENT``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.lib.cpu import cpu_seconds
from bench.stats import COMPONENTS, WORKER_STAGES, Histograms
from bench.workload import as_requests
from ibex_context.client.client import AsyncClient
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleRequest

OK = "OK"
NOT_SENT = "NOT_SENT"
LATE_SLACK_MS = 5.0  # the target: no reply may arrive later than deadline + 5 ms


@dataclass(frozen=True, slots=True)
class Reply:
    """What a target returns for one request: its outcome and, for responses, the server timings."""

    outcome: str  # OK, an error code (DEADLINE_EXCEEDED, ...), or EXC:<type> for an untyped failure
    timings_us: dict[str, int] | None = None
    degraded: bool = False
    worker_id: str = ""
    degraded_reasons: tuple[str, ...] = ()


# Where an OVERLOADED refusal came from, by its message (broker/broker.py, client/client.py): first match wins.
REFUSALS = (("memory service's pace", "refused: dispatch rate"), ("slot(s), and", "refused: queue wait"),
            ("holds", "refused: held slots"), ("memory-service calls is full", "refused: memory gates full"),
            ("pushed out", "refused: pushed out"), ("queue is full", "refused: queue full"),
            ("standing queue", "refused: stale in standing queue"), ("adaptive throttle", "refused: client throttle"))


def refusal_reason(message: str) -> str:
    """A short name for an OVERLOADED refusal's cause (``REFUSALS``), kept in ``Reply.degraded_reasons``."""
    return next((name for text, name in REFUSALS if text in message), "refused: other")


# A target sends request ``i`` with ``timeout_s`` left and returns its Reply.
Call = Callable[[int, float], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class Sample:
    index: int
    scheduled_ns: int  # offset from the run's start
    lag_ns: int  # actual send minus scheduled send
    latency_ns: int  # scheduled send -> terminal outcome (for NOT_SENT: the lag)
    reply: Reply


@dataclass
class RunResult:
    label: str
    offered_rps: float
    duration_s: float
    deadline_ms: float | None
    samples: list[Sample]
    wall_s: float
    gen_cpu_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    def histograms(self) -> Histograms:
        """latency (every sent request), latency_ok (responses), send_lag, and per-component
        histograms for responses that carry server timings."""
        hs = Histograms()
        for s in self.samples:
            if s.reply.outcome == NOT_SENT:
                continue
            hs.record("latency", s.latency_ns / 1000)
            hs.record("send_lag", s.lag_ns / 1000)
            if s.reply.outcome != OK:
                continue
            hs.record("latency_ok", s.latency_ns / 1000)
            t = s.reply.timings_us
            if not t:  # transport mode (or a reply without timings): all of it is the round trip
                hs.record("transport", (s.latency_ns - s.lag_ns) / 1000)
                continue
            for k in ("queue_wait", "worker_wait", *WORKER_STAGES, "total"):
                hs.record(k, t.get(k, 0))
            client_us = (s.latency_ns - s.lag_ns) / 1000
            transport = client_us - t.get("total", 0) - t.get("queue_wait", 0) - t.get("worker_wait", 0)
            hs.record("transport", transport)  # clamped at 0 (and counted) if clocks disagree by a µs
        return hs

    def summary(self) -> dict[str, Any]:
        outcomes = collections.Counter(s.reply.outcome for s in self.samples)
        sent = len(self.samples) - outcomes[NOT_SENT]
        responses = outcomes[OK]
        errors = {k: v for k, v in sorted(outcomes.items()) if k not in (OK, NOT_SENT)}
        deadline_ns = None if self.deadline_ms is None else int(self.deadline_ms * 1e6)
        good = sum(1 for s in self.samples if s.reply.outcome == OK
                   and (deadline_ns is None or s.latency_ns <= deadline_ns))
        complete = sum(1 for s in self.samples if s.reply.outcome == OK and not s.reply.degraded
                       and (deadline_ns is None or s.latency_ns <= deadline_ns))
        late_replies = late_any = 0
        if deadline_ns is not None:
            limit = deadline_ns + int(LATE_SLACK_MS * 1e6)
            late_replies = sum(1 for s in self.samples if s.reply.outcome == OK and s.latency_ns > limit)
            late_any = sum(1 for s in self.samples if s.reply.outcome != NOT_SENT and s.latency_ns > limit)
        hs = self.histograms()
        return {
            "label": self.label,
            **self.meta,
            "offered_rps": round(self.offered_rps, 2),
            "duration_s": self.duration_s,
            "deadline_ms": self.deadline_ms,
            "scheduled": len(self.samples),
            "sent": sent,
            "not_sent_generator_late": outcomes[NOT_SENT],
            "responses": responses,
            "degraded": sum(1 for s in self.samples if s.reply.outcome == OK and s.reply.degraded),
            # Replies whose worker started no retrieval branch at all ("<branch> timeout" with no
            # error class: no time left before the deadline once the worker's reserve was kept back).
            "retrieval_skipped": sum(1 for s in self.samples if s.reply.outcome == OK
                                     and {"directive timeout", "hot timeout", "cold timeout"}
                                     <= set(s.reply.degraded_reasons)),
            "degraded_reasons": dict(collections.Counter(r for s in self.samples if s.reply.outcome == OK
                                                         for r in s.reply.degraded_reasons).most_common()),
            "errors": errors,
            "error_count": sum(errors.values()),
            "untyped_errors": sum(v for k, v in errors.items() if k.startswith("EXC:")),
            "good": good,
            "goodput_rps": round(good / self.duration_s, 2),
            "complete_rps": round(complete / self.duration_s, 2),  # goodput without degraded replies
            "achieved_send_rps": round(sent / self.duration_s, 2),
            "late_replies_after_deadline_5ms": late_replies,
            "late_outcomes_after_deadline_5ms": late_any,
            "workers_seen": dict(collections.Counter(s.reply.worker_id for s in self.samples
                                                     if s.reply.outcome == OK and s.reply.worker_id)),
            "wall_s": round(self.wall_s, 3),
            "generator_cpu_s": round(self.gen_cpu_s, 3),
            "generator_cpu_frac": round(self.gen_cpu_s / self.wall_s, 3) if self.wall_s else None,
            "latency_us": hs.summary(("latency", "latency_ok", *COMPONENTS, "total")),
        }

    def lateness_ms(self) -> np.ndarray:
        """Observed latency minus deadline (ms) for every sent request (negative = early)."""
        if self.deadline_ms is None:
            return np.zeros(0)
        return np.array([s.latency_ns / 1e6 - self.deadline_ms for s in self.samples
                         if s.reply.outcome != NOT_SENT])


def merge_runs(runs: Sequence[RunResult], label: str) -> RunResult:
    """One RunResult from back-to-back segments (interleaved A/B runs): samples are concatenated
    on one time axis; durations, wall and CPU times add up."""
    samples: list[Sample] = []
    offset = 0
    for r in runs:
        samples += [Sample(len(samples) + k, s.scheduled_ns + offset, s.lag_ns, s.latency_ns, s.reply)
                    for k, s in enumerate(r.samples)]
        offset += int(r.duration_s * 1e9)
    return RunResult(label, runs[0].offered_rps, sum(r.duration_s for r in runs), runs[0].deadline_ms, samples,
                     sum(r.wall_s for r in runs), sum(r.gen_cpu_s for r in runs),
                     {**runs[0].meta, "segments": len(runs)})


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the generator's cyclic GC for one timed run, and collect after it.

    The harness keeps every sample of a run in memory; a full collection over that heap stops
    this process for ~100 ms on the dev machine (measured with ``gc.callbacks``), which would be
    charged to whatever service is being measured. Young-generation pauses are 5-15 ms. Reference
    cycles made during a run of a few seconds are collected right after it: with the collector off,
    all the run made is still in the young generations, so collecting those is enough. The old
    generation (every earlier run's samples) is left to the collector between runs: a full
    collection before and after each run would cost that ~100 ms of CPU twice a run.
    """
    was_enabled = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect(1)


def arrival_offsets_ns(rate: float, duration_s: float, *, seed: int) -> np.ndarray:
    """Poisson arrival instants in [0, duration) as int ns offsets (exponential gaps)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = np.random.default_rng(seed)
    chunks: list[np.ndarray] = []
    total = 0.0
    while total < duration_s:
        gaps = rng.exponential(1.0 / rate, int(rate * duration_s) + 64)
        offs = total + np.cumsum(gaps)
        chunks.append(offs)
        total = float(offs[-1])
    offs = np.concatenate(chunks)
    return (offs[offs < duration_s] * 1e9).astype(np.int64)


async def open_loop(call: Call, *, rate: float, duration_s: float, deadline_ms: float | None,
                    label: str = "", seed: int = 1, start_delay_s: float = 0.02,
                    tick: Callable[[int], None] | None = None, meta: dict[str, Any] | None = None,
                    hang_limit_s: float = 5.0) -> RunResult:
    """Send at the offered Poisson ``rate`` for ``duration_s`` and wait for every outcome.

    ``deadline_ms`` None means no deadline (floor runs: ``call`` gets ``hang_limit_s``).
    ``tick(n)`` is called as requests are scheduled (progress bars).
    """
    offsets = arrival_offsets_ns(rate, duration_s, seed=seed)
    samples: list[Sample | None] = [None] * len(offsets)
    deadline_ns = None if deadline_ms is None else int(deadline_ms * 1e6)

    async def one(i: int, at: int) -> None:
        start = time.monotonic_ns()
        lag = max(0, start - at)
        budget = hang_limit_s * 1e9 if deadline_ns is None else deadline_ns - lag
        if budget <= 0:
            samples[i] = Sample(i, at - t0, lag, lag, Reply(NOT_SENT))
            return
        try:
            reply = await call(i, budget / 1e9)
        except Exception as exc:  # the harness must see every outcome, even a bug's
            reply = Reply(f"EXC:{type(exc).__name__}")
        samples[i] = Sample(i, at - t0, lag, time.monotonic_ns() - at, reply)

    tasks: set[asyncio.Task[None]] = set()
    ticked = 0
    with gc_paused():
        t0 = time.monotonic_ns() + int(start_delay_s * 1e9)
        cpu0, wall0 = cpu_seconds(), time.monotonic()
        for i, off in enumerate(offsets.tolist()):
            at = t0 + off
            delay = at - time.monotonic_ns()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            task = asyncio.create_task(one(i, at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if tick is not None and i - ticked >= 50:
                tick(i - ticked)
                ticked = i
        if tasks:
            limit = hang_limit_s + (deadline_ms or 0) / 1000
            _done, hung = await asyncio.wait(set(tasks), timeout=limit)
            for task in hung:
                task.cancel()
            await asyncio.gather(*hung, return_exceptions=True)
        wall = time.monotonic() - wall0
        cpu = cpu_seconds() - cpu0
    if tick is not None:
        tick(len(offsets) - ticked)
    final = [s if s is not None else Sample(i, int(offsets[i]), 0, int(wall * 1e9), Reply("HUNG"))
             for i, s in enumerate(samples)]
    return RunResult(label, rate, duration_s, deadline_ms, final, wall, cpu, dict(meta or {}))


class ClientTarget:
    """Sends through the real ``AsyncClient``; each send gets a fresh request_id.

    Transport-mode workers (``bench.lib.transport``) answer at once with a minimal valid response
    (``bench.lib.transport.transport_response``), which counts as a reply like any other.
    """

    def __init__(self, client: AsyncClient, templates: Sequence[AssembleRequest], *, tag: str) -> None:
        self.client = client
        self.requests = as_requests(templates)
        self.tag = tag

    async def __call__(self, i: int, timeout_s: float) -> Reply:
        req = self.requests.nth(i).model_copy(update={"request_id": f"{self.tag}-{i}"})
        try:
            resp = await self.client.assemble(req, timeout=timeout_s)
        except IbexError as exc:
            return Reply(exc.code.value, degraded_reasons=(refusal_reason(str(exc)),) if exc.code.value == "OVERLOADED"
                         else ())
        return Reply(OK, dict(resp.timings_us), resp.degraded, resp.worker_id, tuple(resp.degraded_reasons))
