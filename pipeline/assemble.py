"""The pipeline's one entry point: budget -> score -> pack -> format -> response.

``assemble`` turns a request and what retrieval returned into the ``AssembleResponse``. The worker
calls it after its retrieval wall, ``ops explain`` on a file and the client for its degraded
response (README "Processes and data flow"), so all three answer with the same accounting.

Deadlines (README "Deadlines"): with a ``Clock`` the deadline is checked before every CPU stage.
numpy cannot be interrupted, so expired work must simply not be started: an expired request
raises ``DeadlineExceeded`` and spends no more CPU. Offline callers pass no clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ibex_context.pipeline import format as fmt
from ibex_context.pipeline.budget import compute_budget, counter_for
from ibex_context.pipeline.count import (
    CountedSection,
    LineCache,
    MemoryCost,
    RequestSections,
    count_request,
    directive_counted,
    fit_memory_section,
    joins_overhead,
    memory_overhead,
    memory_tokens_bound,
)
from ibex_context.pipeline.decisions import decisions
from ibex_context.pipeline.pack import pack
from ibex_context.pipeline.score import score_candidates
from ibex_context.pipeline.types import PackResult, Rejection, RetrievalResult, ScoredMemory
from ibex_context.shared.calibration import Calibration
from ibex_context.shared.catalog import Catalog, ModelSpec
from ibex_context.shared.errors import DeadlineExceeded
from ibex_context.shared.models import AssembleRequest, AssembleResponse, BudgetBreakdown, PackedMemory, PackerStats
from ibex_context.shared.settings import Settings
from ibex_context.shared.tokens import TokenCount, TokenCounter

STAGES = ("retrieval", "budget", "scoring", "packing", "formatting")


@dataclass(slots=True)
class Clock:
    """One request's deadline on the monotonic clock, checked before each CPU stage.

    ``started`` lists the stages whose check passed, so a caller can tell how far an expired
    request got (the worker counts assemblies that reached the packer).
    """

    deadline_mono_ns: int
    request_id: str = ""
    started: list[str] = field(default_factory=list)

    def check(self, stage: str) -> int:
        """The monotonic time now; ``DeadlineExceeded`` when ``stage`` must not start."""
        now = time.monotonic_ns()
        if now >= self.deadline_mono_ns:
            raise DeadlineExceeded(
                f"deadline passed {(now - self.deadline_mono_ns) / 1e6:.2f} ms before {stage} could start",
                request_id=self.request_id,
            )
        self.started.append(stage)
        return now


@dataclass(frozen=True, slots=True)
class Policy:
    """The settings the pure stages read (README "Budget and token counting").

    ``verify_format`` re-counts the rendered memories section exactly and drops memories if the
    additive bound was wrong (``explain``; it costs a full BPE pass); otherwise the bound is used
    (tested for every family in tests/test_format.py).
    """

    reserve_fraction: float = 0.15
    constrained_below: int = 256
    verify_format: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, *, verify_format: bool = False) -> Policy:
        return cls(settings.response_reserve_fraction, settings.constrained_below_tokens, verify_format)


@dataclass(frozen=True, slots=True)
class Planned:
    """The budget stage's output: the counted sections outside the memories block and the budget."""

    directive: CountedSection
    request: RequestSections
    memory_overhead: int
    budget: BudgetBreakdown


@dataclass(frozen=True, slots=True)
class Scored:
    """The scoring stage's output: candidates for the packer, and every hit refused before it."""

    scored: list[ScoredMemory]
    rejected: list[Rejection]


@dataclass(frozen=True, slots=True)
class Formatted:
    """The formatting stage's output: the text, and which packed memories made it in."""

    rendered: fmt.Rendered
    kept: list[ScoredMemory]
    dropped: list[ScoredMemory]


def assemble(
    req: AssembleRequest, retrieval: RetrievalResult, *, catalog: Catalog, policy: Policy,
    nonce: str | None = None, clock: Clock | None = None, lines: LineCache | None = None,
    sections: RequestSections | None = None, timings_us: dict[str, int] | None = None, worker_id: str = "",
    calibration: Calibration | None = None,
) -> AssembleResponse:
    """Budget, score, pack and format ``retrieval`` for ``req``; no I/O.

    ``sections``: the request's history and tools already counted (the worker counts them while
    retrieval is in flight, with ``counter_for``'s counter). ``lines``: the worker's cache of
    rendered memory lines. ``timings_us``: stage timings measured before this call (queue wait,
    retrieval), carried on. ``calibration``: the (org, model) ratio learned from usage reports,
    when it has enough samples (README "Calibrated token counts").
    """
    timings = dict(timings_us or {})
    explicit = bool(nonce)  # explain's --nonce and tests: used as given, never re-derived
    nonce = fmt.check_nonce(nonce) if nonce else fmt.new_nonce()
    if req.format is not None:  # the proxy's own conversation (README "Chat-native assembly")
        from ibex_context.pipeline.chat_assemble import assemble_chat

        return assemble_chat(req, retrieval, catalog=catalog, policy=policy, nonce=nonce, clock=clock, lines=lines,
                             timings=timings, worker_id=worker_id, derive_nonce=not explicit, calibration=calibration)
    spec = catalog.model(req.model)
    counter = counter_for(catalog, spec, calibration)

    t = _tick(clock, "budget")
    planned = budget_stage(req, retrieval, spec, counter, nonce=nonce, policy=policy, sections=sections,
                           calibration=calibration)
    timings["budget"] = _us(t, _tick(clock, "scoring"))
    scored, result, t4 = score_and_pack(req, retrieval, counter, lines, planned.budget.usable, clock, timings)
    nonce = block_nonce(req, result, lines, nonce, derive=not explicit)
    formatted = formatting_stage(planned, result, counter, nonce=nonce, lines=lines, verify=policy.verify_format)
    timings["formatting"] = _us(t4, time.monotonic_ns())
    timings["total"] = sum(timings.get(k, 0) for k in STAGES)
    return response(req, retrieval, planned, scored, result, formatted, timings=timings, nonce=nonce,
                    worker_id=worker_id)


def score_and_pack(
    req: AssembleRequest, retrieval: RetrievalResult, counter: TokenCounter, lines: LineCache | None, usable: int,
    clock: Clock | None, timings: dict[str, int],
) -> tuple[Scored, PackResult, int]:
    """The scoring and packing stages, timed, for every request form; returns the monotonic time
    the formatting stage may start (its deadline check passed)."""
    t2 = time.monotonic_ns()
    scored = scoring_stage(req, retrieval, MemoryCost(counter, lines))
    t3 = _tick(clock, "packing")
    timings["scoring"] = _us(t2, t3)
    result = pack(scored.scored, usable)
    t4 = _tick(clock, "formatting")
    timings["packing"] = _us(t3, t4)
    return scored, result, t4


def block_nonce(req: AssembleRequest, result: PackResult, lines: LineCache | None, nonce: str, *,
                derive: bool) -> str:
    """The memories block's nonce, chosen before the block is rendered (once, for every form).

    Derived from the packed memories' lines (``fmt.derive_nonce``): the same memories give the
    same block bytes turn after turn (README "Prompt caching"). ``nonce`` stands when the caller
    fixed it (``derive`` false), the request asks for ``"random"``, or nothing was packed. The
    budget's frame overhead is a bound over every nonce value, so it holds for the derived one.
    """
    if not derive or req.options.nonce != "derived" or not result.packed:
        return nonce
    render = lines.line if lines is not None else fmt.memory_line
    return fmt.derive_nonce(fmt.default_nonce_key(), [render(m.hit) for m in result.packed])


def _tick(clock: Clock | None, stage: str) -> int:
    return clock.check(stage) if clock is not None else time.monotonic_ns()


def _us(a: int, b: int) -> int:
    return max(0, (b - a) // 1000)


def budget_stage(
    req: AssembleRequest, retrieval: RetrievalResult, spec: ModelSpec, counter: TokenCounter, *,
    nonce: str, policy: Policy, sections: RequestSections | None, calibration: Calibration | None = None,
) -> Planned:
    """Count everything outside the memories and subtract it from the window (README "Budget and
    token counting"): the packer then spends only what is left."""
    request = sections if sections is not None else count_request(counter, req)
    directive = directive_counted(counter, retrieval.directive)
    overhead_mem = memory_overhead(counter, nonce)
    overhead_n = overhead_mem + joins_overhead(counter, (directive, request.history, request.tools))
    fam, kind = counter.family, counter.kind
    budget = compute_budget(
        spec,
        directive=TokenCount(directive.tokens, fam, kind),
        messages=TokenCount(request.history.tokens, fam, kind),
        tool_schemas=TokenCount(request.tools.tokens, fam, kind),
        formatter_overhead=TokenCount(overhead_n, fam, kind),
        reserve_fraction=policy.reserve_fraction,
        constrained_below=policy.constrained_below,
        calibration=calibration,
    )
    return Planned(directive, request, overhead_mem, budget)


def scoring_stage(req: AssembleRequest, retrieval: RetrievalResult, cost: MemoryCost) -> Scored:
    """Score every copy retrieval kept, then apply the request's ``max_memories``.

    The scorer sees ``[*hot, *cold]`` and picks the copy of a repeated memory_id itself, since it
    knows which copy's scores are valid (one decision per memory, README "Scoring and packing").
    """
    opts = req.options
    scored, rejected = score_candidates([*retrieval.hot, *retrieval.cold], cost, min_score=opts.min_score,
                                        weights=opts.weights.as_tuple() if opts.weights else None, rule=opts.score)
    limit = req.options.max_memories
    if limit is None or len(scored) <= limit:
        return Scored(scored, rejected)
    ranked = sorted(scored, key=lambda m: (-m.composite_score, m.memory_id))
    over = [Rejection(m.memory_id, m.hit.source, "over_limit",
                      f"request allows at most {limit} memories; this one ranked lower",
                      tokens=m.tokens, score=m.composite_score) for m in ranked[limit:]]
    return Scored(ranked[:limit], [*rejected, *over])


def formatting_stage(
    planned: Planned, result: PackResult, counter: TokenCounter, *, nonce: str, lines: LineCache | None,
    verify: bool,
) -> Formatted:
    """Render the sections in their fixed order; the memories section by the exact re-count
    (``verify``) or by the additive bound the budget was computed with."""
    if verify:
        fitted = fit_memory_section(counter, result.packed, nonce, result.total_tokens + planned.memory_overhead)
        memories = CountedSection(fitted.text, fitted.tokens)
        kept, dropped = fitted.kept, fitted.dropped
    else:
        kept, dropped = list(result.packed), []
        text = fmt.memory_section(kept, nonce, lines.line if lines is not None else fmt.memory_line)
        memories = CountedSection(
            text, memory_tokens_bound(counter, result.total_tokens, planned.memory_overhead) if kept else 0)
    d, h, t = planned.directive, planned.request.history, planned.request.tools
    rendered = fmt.assemble_text([("directive", d.text, d.tokens), ("history", h.text, h.tokens),
                                  ("memories", memories.text, memories.tokens), ("tools", t.text, t.tokens)])
    return Formatted(rendered, kept, dropped)


def response(
    req: AssembleRequest, retrieval: RetrievalResult, planned: Planned, scored: Scored, result: PackResult,
    formatted: Formatted, *, timings: dict[str, int], nonce: str, worker_id: str,
) -> AssembleResponse:
    """The wire response: what was packed, every decision, the budget and the packer's stats."""
    budget, kept, dropped = planned.budget, formatted.kept, formatted.dropped
    reasons = retrieval.degraded_reasons
    return AssembleResponse(
        request_id=req.request_id,
        rendered=formatted.rendered.text,
        sections=list(formatted.rendered.sections),
        packed=[PackedMemory(memory_id=m.memory_id, category=m.hit.category, tokens=m.tokens,
                             score=m.composite_score, source=m.hit.source) for m in kept],
        decisions=decisions(retrieval, scored.rejected, kept, list(result.excluded), dropped, budget.usable),
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
        degraded=bool(reasons),
        degraded_reasons=reasons,
        timings_us=timings,
        nonce=nonce,
        worker_id=worker_id,
        org_id=req.org_id,
        agent_id=req.agent_id,
    )
