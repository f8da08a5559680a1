"""The online half of an assembly: retrieval under its wall, then the pure pipeline.

Deadlines (docs/architecture.md "Deadlines"): the wire's absolute epoch deadline is converted once, on receipt
(worker/server.py), into a local monotonic ``deadline_mono_ns``; ``pipeline.assemble.Clock``
checks it before every stage, retrieval included.

The retrieval wall is min(IBEX_RETRIEVAL_TIMEOUT_MS, IBEX_CONTEXT_DEADLINE_MS) and never later than the
request deadline minus the measured p95 of the post-retrieval stages (``StageCostTracker``) and
of the reply's transit.
"""

from __future__ import annotations

import collections
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext

from ..pipeline.assemble import Clock, Engine, Policy, assemble
from ..pipeline.budget.catalog import Catalog
from ..pipeline.budget.usable import counter_for
from ..pipeline.counting.count import LineCache
from ..pipeline.rendering.turns import count_turns
from ..shared.config.settings import WorkerSettings
from ..shared.wire.models import AssembleRequest, AssembleResponse
from .calibration import Calibrator
from .retrieve import Retriever

Turn = Callable[[], AbstractAsyncContextManager[None]]


def _turn(turn: Turn | None) -> AbstractAsyncContextManager[None]:
    return turn() if turn is not None else nullcontext()


class StageCostTracker:
    """A recent high percentile of a duration, for keeping time back from the retrieval wall.

    p95 over the last ``window`` samples: high enough to cover the usual tail, low enough that a
    short overload does not leave a reserve so large that every later request skips retrieval.
    Until ``window // 4`` samples exist the configured initial value is the floor.
    """

    def __init__(self, initial_ms: float, window: int = 128, quantile: float = 0.95) -> None:
        self._samples: deque[int] = deque(maxlen=window)
        self._initial_ns = int(initial_ms * 1e6)
        self._quantile = quantile
        self._value_ns = self._initial_ns
        self._since = 0

    def observe(self, ns: int) -> None:
        self._samples.append(ns)
        self._since += 1
        warm = len(self._samples) >= (self._samples.maxlen or 1) // 4
        if self._since >= 16 or not warm:
            self._since = 0
            ordered = sorted(self._samples)
            measured = ordered[min(len(ordered) - 1, int(len(ordered) * self._quantile))]
            self._value_ns = measured if warm else max(measured, self._initial_ns)

    @property
    def reserve_ns(self) -> int:
        return self._value_ns


class Assembler:
    """Runs assemblies for one worker process: retrieval, then ``pipeline.assemble``."""

    def __init__(self, *, settings: WorkerSettings, catalog: Catalog, retriever: Retriever | None,
                 worker_id: str = "", calibrator: Calibrator | None = None) -> None:
        self.settings = settings
        self.calibrator = calibrator  # usage-report calibration (docs/assembly.md "Calibrated token counts")
        # What every assembly of this process runs with; the line cache is kept across requests.
        self.engine = Engine(catalog, Policy.from_settings(settings), lines=LineCache(), worker_id=worker_id)
        self.retriever = retriever
        self.post_cost = StageCostTracker(settings.post_retrieval_reserve_ms)
        # One-way broker -> worker transit; the reply crosses two such hops (worker -> broker -> client).
        self.transit = StageCostTracker(1.0)
        self.stats: collections.Counter[str] = collections.Counter()  # stage entries, for metrics/tests

    def reserve_ns(self) -> int:
        """Time kept back after retrieval: measured p95 of the CPU stages plus the reply's two hops
        (plus 1 ms of scheduling slack), capped so an overloaded moment cannot starve retrieval."""
        measured = self.post_cost.reserve_ns + 2 * self.transit.reserve_ns + 1_000_000
        return min(measured, int(self.settings.max_reply_reserve_ms * 1e6))

    async def assemble(
        self, req: AssembleRequest, *, deadline_mono_ns: int, nonce: str | None = None,
        timings_us: dict[str, int] | None = None, transit_ns: int | None = None, turn: Turn | None = None,
        busy: Callable[[], int] | None = None, memory: bool = True,
    ) -> AssembleResponse:
        """Retrieve against the live backing services, then run the pipeline on what came back;
        ``turn`` gives each synchronous stage its fair turn on the worker's loop (``worker.fair``),
        ``busy`` is the loop's time in those turns (ns, cumulative), given back to retrieval's limits."""
        if transit_ns is not None:
            self.transit.observe(max(0, transit_ns))
        if self.retriever is None:
            raise RuntimeError("this Assembler has no retriever; offline work calls pipeline.assemble")
        clock = Clock(deadline_mono_ns, req.request_id)
        t_start = clock.check("retrieval")
        spec = self.engine.catalog.model(req.model)  # unknown model: INVALID_REQUEST before any I/O
        calibration = self.calibrator.lookup(req.org_id, spec.name) if self.calibrator is not None else None
        # Parse and count the conversation first: a bad one is refused before any Redis or memory-service call.
        async with _turn(turn):
            counted = count_turns(req, spec, counter_for(self.engine.catalog, spec, calibration))
        t_start = time.monotonic_ns()
        last = deadline_mono_ns - self.reserve_ns()  # the latest end of retrieval the deadline allows
        wall_end = min(t_start + int(self.settings.retrieval_wall_ms * 1e6), last)
        wait = self.retriever.start(req, wall_end_ns=wall_end, last_ns=last, busy=busy, memory=memory)
        retrieval = await wait()
        t_retrieved = time.monotonic_ns()
        timings = {**(timings_us or {}), "retrieval": max(0, (t_retrieved - t_start) // 1000)}
        async with _turn(turn):
            try:
                resp = assemble(req, retrieval, self.engine, nonce=nonce, clock=clock, counted=counted,
                                timings_us=timings, calibration=calibration)
            finally:
                if "packing" in clock.started:
                    self.stats["packing"] += 1
        self.post_cost.observe(time.monotonic_ns() - t_retrieved)
        if self.calibrator is not None:  # the id a usage report names, and the service's own count for it
            resp = self.calibrator.issue(resp, org_id=req.org_id, model=spec.name)
        return resp
