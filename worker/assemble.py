"""The whole pipeline in one call: retrieve -> budget -> score -> pack -> format -> response.

Deadlines: the wire's absolute epoch deadline is converted once (by the transport) into a local
monotonic ``deadline_ns``. The deadline is checked before every CPU stage: numpy cannot be
interrupted, so expired work must simply not be started (STYLE: "check the deadline before each
CPU stage"). An expired request raises ``DeadlineExceeded`` and spends no more CPU.

The retrieval wall is min(IBEX_CONTEXT_TIMEOUT, IBEX_CONTEXT_DEADLINE_MS) and never later than the
request deadline minus the measured p99 of the post-retrieval stages (``StageCostTracker``).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ibex_context.pipeline import format as fmt
from ibex_context.pipeline.budget import compute_budget
from ibex_context.pipeline.pack import pack
from ibex_context.pipeline.score import score_candidates
from ibex_context.pipeline.types import Rejection, ScoredMemory
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import DeadlineExceeded
from ibex_context.shared.models import (
    AssembleRequest,
    AssembleResponse,
    Decision,
    PackedMemory,
    PackerStats,
    SectionName,
)
from ibex_context.shared.settings import Settings
from ibex_context.shared.tokens import CachedCounter, TokenCount
from ibex_context.worker.retrieve import RetrievalResult, Retriever


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


@dataclass(frozen=True, slots=True)
class Clock:
    """Deadline checks for one request (monotonic ns)."""

    deadline_ns: int

    def check(self, stage: str, request_id: str) -> int:
        now = time.monotonic_ns()
        if now >= self.deadline_ns:
            raise DeadlineExceeded(
                f"deadline passed {(now - self.deadline_ns) / 1e6:.2f} ms before {stage} could start",
                request_id=request_id,
            )
        return now


def _count_request_sections(counter: CachedCounter, req: AssembleRequest) -> tuple[str, int, str, int]:
    """History and tool-schema sections with their token counts: the parts that need no I/O."""
    history, history_n = fmt.history_counted(counter, req.recent_messages)
    tools, tools_n = fmt.tools_counted(counter, req.tool_schemas)
    return history, history_n, tools, tools_n


def _us(a: int, b: int) -> int:
    return max(0, (b - a) // 1000)


class Assembler:
    """Runs assemblies for one worker process (or in-process for ``explain`` and the bench)."""

    def __init__(self, *, settings: Settings, catalog: Catalog, retriever: Retriever | None,
                 worker_id: str = "", verify_format: bool = False) -> None:
        self.settings = settings
        self.verify_format = verify_format
        self.catalog = catalog
        self.retriever = retriever
        self.worker_id = worker_id
        self.post_cost = StageCostTracker(settings.post_retrieval_reserve_ms)
        # One-way broker -> worker transit; the reply crosses two such hops (worker -> broker -> client).
        self.transit = StageCostTracker(1.0)
        self.stats: collections.Counter[str] = collections.Counter()  # stage entries, for metrics/tests
        self.lines = fmt.LineCache()

    def reserve_ns(self) -> int:
        """Time kept back after retrieval: measured p95 of the CPU stages plus the reply's two hops
        (plus 1 ms of scheduling slack), capped so an overloaded moment cannot starve retrieval."""
        measured = self.post_cost.reserve_ns + 2 * self.transit.reserve_ns + 1_000_000
        return min(measured, int(self.settings.max_reply_reserve_ms * 1e6))

    async def assemble(
        self, req: AssembleRequest, *, deadline_ns: int, nonce: str | None = None,
        timings_us: dict[str, int] | None = None, transit_ns: int | None = None,
    ) -> AssembleResponse:
        """Run the pipeline against the live backing services."""
        if transit_ns is not None:
            self.transit.observe(max(0, transit_ns))
        if self.retriever is None:
            raise RuntimeError("this Assembler has no retriever; use build_response for offline work")
        clock = Clock(deadline_ns)
        t_start = clock.check("retrieval", req.request_id)
        spec = self.catalog.model(req.model)  # unknown model: INVALID_REQUEST before any I/O
        wall_end = min(
            t_start + int(self.settings.retrieval_wall_ms * 1e6),
            deadline_ns - self.reserve_ns(),
        )
        wait = self.retriever.start(req, wall_end_ns=wall_end)
        counter = self.catalog.counter(spec.family.name)
        # Let the branches send their requests, then count what needs no I/O while they are in flight.
        await asyncio.sleep(0)
        pre = _count_request_sections(counter, req)
        retrieval = await wait()
        t_retrieved = time.monotonic_ns()
        timings = dict(timings_us or {})
        timings["retrieval"] = _us(t_start, t_retrieved)
        resp = self.build_response(req, retrieval, clock=clock, nonce=nonce, timings_us=timings, precounted=pre)
        self.post_cost.observe(time.monotonic_ns() - t_retrieved)
        return resp

    def build_response(
        self, req: AssembleRequest, retrieval: RetrievalResult, *, clock: Clock | None = None,
        nonce: str | None = None, timings_us: dict[str, int] | None = None,
        precounted: tuple[str, int, str, int] | None = None,
    ) -> AssembleResponse:
        """The pure CPU half of the pipeline: budget, score, pack, format (no I/O)."""
        check: Callable[[str], int] = (
            (lambda stage: clock.check(stage, req.request_id)) if clock else (lambda _s: time.monotonic_ns())
        )
        timings = dict(timings_us or {})
        nonce = fmt.check_nonce(nonce) if nonce else fmt.new_nonce()
        spec = self.catalog.model(req.model)
        counter = self.catalog.counter(spec.family.name)
        fam, kind = counter.family, counter.kind

        t = check("budget")
        if precounted is None:
            precounted = _count_request_sections(counter, req)
        history, history_n, tools, tools_n = precounted
        directive = fmt.directive_section(retrieval.directive)
        directive_n = counter.count(directive)
        joins = sum(1 for s in (directive, history, tools) if s)
        join_n = counter.count(fmt.SECTION_JOIN) * max(0, joins - 1)
        overhead_mem = fmt.memory_overhead(counter, nonce)
        overhead_n = overhead_mem + join_n
        budget = compute_budget(
            spec,
            directive=TokenCount(directive_n, fam, kind),
            messages=TokenCount(history_n, fam, kind),
            tool_schemas=TokenCount(tools_n, fam, kind),
            formatter_overhead=TokenCount(overhead_n, fam, kind),
            reserve_fraction=self.settings.response_reserve_fraction,
            constrained_below=self.settings.constrained_below_tokens,
        )
        t2 = check("scoring")
        timings["budget"] = _us(t, t2)

        # Every copy retrieval kept goes to the scorer, which knows which copy's scores are valid and
        # so picks the copy of a repeated memory_id (one decision per memory, worker/score.py).
        scored, rejected = score_candidates(
            [*retrieval.hot, *retrieval.cold], lambda h: fmt.memory_cost(counter, h, self.lines),
            min_score=req.options.min_score
        )
        limit = req.options.max_memories
        if limit is not None and len(scored) > limit:
            ranked = sorted(scored, key=lambda m: (-m.composite_score, m.memory_id))
            scored = ranked[:limit]
            rejected = [*rejected, *(
                Rejection(m.memory_id, m.hit.source, "over_limit",
                          f"request allows at most {limit} memories; this one ranked lower",
                          tokens=m.tokens, score=m.composite_score)
                for m in ranked[limit:]
            )]
        t3 = check("packing")
        self.stats["packing"] += 1
        timings["scoring"] = _us(t2, t3)

        result = pack(scored, budget.usable)
        t4 = check("formatting")
        timings["packing"] = _us(t3, t4)

        if self.verify_format:  # exact re-count of the rendered section (explain; costs a full BPE pass)
            mem_text, kept, dropped = fmt.fit_memory_section(
                counter, result.packed, nonce, result.total_tokens + overhead_mem)
            mem_tokens = counter.count(mem_text) if mem_text else 0
        else:  # the additive bound (tested for every family in tests/test_format.py)
            kept, dropped = list(result.packed), []
            mem_text = fmt.memory_section(kept, nonce, self.lines)
            mem_tokens = result.total_tokens + overhead_mem - counter.count(fmt.SECTION_JOIN) if kept else 0
        parts: list[tuple[SectionName, str, int]] = [
            ("directive", directive, directive_n), ("history", history, history_n),
            ("memories", mem_text, mem_tokens), ("tools", tools, tools_n),
        ]
        rendered = fmt.assemble_text(parts)
        t5 = time.monotonic_ns()
        timings["formatting"] = _us(t4, t5)
        timings["total"] = sum(timings.get(k, 0) for k in ("retrieval", "budget", "scoring", "packing", "formatting"))

        decisions = _decisions(retrieval, rejected, kept, list(result.excluded), dropped, budget.usable)
        degraded_reasons = retrieval.degraded_reasons
        return AssembleResponse(
            request_id=req.request_id,
            rendered=rendered.text,
            sections=list(rendered.sections),
            packed=[PackedMemory(memory_id=m.memory_id, category=m.hit.category, tokens=m.tokens,
                                 score=m.composite_score, source=m.hit.source) for m in kept],
            decisions=decisions,
            budget=budget,
            constrained=budget.constrained,
            branches=retrieval.outcomes,
            packer=PackerStats(
                path=result.path, evaluated=result.evaluated,
                excluded_for_budget=result.excluded_for_budget + len(dropped),
                budget_reached=result.budget_reached or bool(dropped),
                total_tokens=sum(m.tokens for m in kept),
                total_score=sum(m.composite_score for m in kept), token_budget=budget.usable,
            ),
            degraded=bool(degraded_reasons),
            degraded_reasons=degraded_reasons,
            timings_us=timings,
            nonce=nonce,
            worker_id=self.worker_id,
        )


def _decisions(
    retrieval: RetrievalResult, rejected: list[Rejection], kept: list[ScoredMemory],
    excluded: list[ScoredMemory], dropped: list[ScoredMemory], usable: int,
) -> list[Decision]:
    """One decision per distinct memory_id, plus a ``duplicate`` for every other copy of it.

    The scorer already keeps one copy per id. A copy retrieval refused (malformed or over its
    branch cap) under an id that also has a scored copy is reported as a ``duplicate`` that names
    what happened to the scored copy, so an id never gets two contradictory answers.
    """
    packing = _Packing(sum(m.tokens for m in kept), math.fsum(m.composite_score for m in kept),
                       sorted(m.composite_score for m in kept), usable)
    rows = [_rejected(r) for r in rejected]
    rows += [Decision(memory_id=m.memory_id, source=m.hit.source, decision="packed",
                      reason=f"packed: {m.tokens} tokens, interim score {m.composite_score:.4f}",
                      tokens=m.tokens, score=m.composite_score) for m in kept]
    rows += [_excluded(m, _budget_reason(m, packing)) for m in excluded]
    rows += [_excluded(m, (f"packed, then dropped: the rendered memories section counted more tokens than "
                           f"its per-memory estimate, and at score {m.composite_score:.4f} this was the "
                           f"lowest-scored memory")) for m in dropped]
    answered = {d.memory_id: d for d in rows if d.decision != "duplicate"}
    early: list[Decision] = []
    for r in retrieval.rejections:
        if r.decision == "duplicate":  # superseded: the scorer chose among the copies (above)
            continue
        first = answered.get(r.memory_id)
        if first is None:
            answered[r.memory_id] = d = _rejected(r)
        else:
            d = Decision(memory_id=r.memory_id, source=r.source, decision="duplicate",
                         reason=(f"duplicate memory_id: the {first.source} copy was kept ({first.decision}); "
                                 f"this copy was {r.decision}: {r.reason}"))
        early.append(d)
    return [*early, *rows]


def _rejected(r: Rejection) -> Decision:
    return Decision(memory_id=r.memory_id, source=r.source, decision=r.decision, reason=r.reason,
                    tokens=r.tokens, score=_unit(r.score))


def _excluded(m: ScoredMemory, reason: str) -> Decision:
    return Decision(memory_id=m.memory_id, source=m.hit.source, decision="excluded_budget", reason=reason,
                    tokens=m.tokens, score=m.composite_score)


@dataclass(frozen=True, slots=True)
class _Packing:
    """What was packed, summarised once for the budget reasons."""

    tokens: int
    total_score: float
    scores: list[float]  # ascending
    usable: int


def _budget_reason(m: ScoredMemory, p: _Packing) -> str:
    """Why a memory was left out for budget, saying only what is true of this packing.

    A memory larger than the whole budget was never in competition with anything; otherwise it
    lost to the packed set, whose members need not each score higher (the packer maximises the
    total score, README "Scoring and packing").
    """
    if m.tokens > p.usable or p.usable <= 0:
        return f"needs {m.tokens} tokens, budget is {p.usable}"
    left = p.usable - p.tokens
    short = m.tokens - left
    if short <= 0:  # the packer refills whatever fits; said plainly should that ever change
        return f"needs {m.tokens} tokens and {left} of {p.usable} were left, but the packer did not take it"
    lower = bisect.bisect_left(p.scores, m.composite_score)  # packed memories scoring below this one
    head = f"needs {m.tokens} tokens but only {left} of {p.usable} were left"
    if lower == 0:
        return f"{head} after {len(p.scores)} memories scoring at least as high (short by {short})"
    return (f"{head} after {len(p.scores)} packed memories, total score {p.total_score:.4f} (short by {short}); "
            f"{lower} of them score lower: the packer maximises the total score, not each memory's")


def _unit(v: float | None) -> float | None:
    """Scores echoed in decisions must be valid numbers; an invalid one is described in the reason."""
    if v is None or not (0.0 <= v <= 1.0):
        return None
    return v

