"""The pipeline's one entry point, one pass for every request form:

    count_turns (parse, count)  ->  summary_slot  ->  fit_stage (history, budget)  ->  scoring_stage
    ->  pack  ->  emit_stage (memories block, render, count)  ->  response

``assemble`` turns a request and what retrieval returned into the ``AssembleResponse``. The worker
calls it after its retrieval wall (having parsed and counted the conversation before any I/O),
``ops explain`` on a file and the client for its degraded response (docs/architecture.md "Processes and data
flow"), so all three answer with the same accounting. The request form matters only at the two
ends: ``pipeline.rendering.turns`` makes one conversation of it, and the renderer it picks emits it
(``pipeline.rendering.render``: the flat text, OpenAI or Anthropic messages).

Deadlines (docs/architecture.md "Deadlines"): with a ``Clock`` the deadline is checked before every CPU stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter

from ..shared.wire.editing import MessageEdit
from ..shared.wire.models import (
    AssembleRequest,
    AssembleResponse,
    CountRule,
    PackerStats,
)
from . import format as fmt
from .budget.catalog import Catalog
from .budget.policy import Clock, Policy, elapsed_us, tick
from .budget.usable import counter_for
from .conversation import context_edit, summary
from .conversation.fit import Counted, Limits, Plan, fit_stage, history_decisions
from .conversation.summary import Slot
from .counting.calibration import Calibration
from .counting.count import LineCache, MemoryCost
from .decisions import decisions
from .rendering.emit import Nonce, Output, emit_stage
from .rendering.render import Renderer
from .rendering.turns import count_turns
from .selection.pack import pack
from .selection.score import score_candidates
from .types import Rejection, RetrievalResult, ScoredMemory

__all__ = ["STAGES", "Clock", "Engine", "Policy", "assemble", "scoring_stage"]

STAGES = ("retrieval", "budget", "scoring", "packing", "formatting")
_TOKENS = attrgetter("tokens")
_SCORE = attrgetter("composite_score")


@dataclass(frozen=True, slots=True)
class Engine:
    """What a process assembles with, made once: the model catalog, the settings the stages read,
    the cache of rendered memory lines (the worker's; None: each line rendered when needed) and
    the ``worker_id`` its replies carry."""

    catalog: Catalog
    policy: Policy
    lines: LineCache | None = None
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class CountBasis:
    """What the emitted prompt's count rests on: the rule that made it (``kind``), and the same
    prompt by the catalog's rule alone (``uncalibrated``: what a usage report's ratio is taken against)."""

    kind: CountRule
    uncalibrated: int


@dataclass(frozen=True, slots=True)
class Scored:
    """The scoring stage's output: candidates for the packer, and every hit refused before it."""

    scored: list[ScoredMemory]
    rejected: list[Rejection]


def assemble(
    req: AssembleRequest, retrieval: RetrievalResult, engine: Engine, *, nonce: str | None = None,
    clock: Clock | None = None, counted: Counted[Renderer] | None = None, timings_us: dict[str, int] | None = None,
    calibration: Calibration | None = None,
) -> AssembleResponse:
    """Fit, budget, score, pack and render ``retrieval`` for ``req`` with ``engine``; no I/O.

    ``clock``: this request's deadline. ``counted``: the request's conversation already parsed and
    counted (``pipeline.rendering.turns.count_turns`` with ``counter_for``'s counter; the worker does it
    before retrieval). ``timings_us``: stage timings measured before this call (queue wait,
    retrieval), carried on. ``calibration``: the (org, model) ratio learned from usage reports,
    when it has enough samples (docs/assembly.md "Calibrated token counts").
    """
    catalog, policy, lines = engine.catalog, engine.policy, engine.lines
    timings = dict(timings_us or {})
    explicit = bool(nonce)  # explain's --nonce and tests: used as given, never re-derived
    chosen = Nonce(fmt.check_nonce(nonce) if nonce else fmt.new_nonce(),
                   not explicit and req.options.nonce == "derived", policy.nonce_key)
    spec = catalog.model(req.model)
    counter = counter_for(catalog, spec, calibration)
    t = tick(clock, "budget")
    counted = counted if counted is not None else count_turns(req, spec, counter)
    slot = summary_slot(req, retrieval, counted, chosen)
    plan = fit_stage(counted, req.history, retrieval.directive, spec, counter, nonce=chosen.value,
                     limits=Limits(policy.reserve_fraction, policy.constrained_below, calibration), summary=slot)
    t2 = tick(clock, "scoring")
    timings["budget"] = elapsed_us(t, t2)
    scored = scoring_stage(req, retrieval, MemoryCost(counter, lines))
    t3 = tick(clock, "packing")
    timings["scoring"] = elapsed_us(t2, t3)
    result = pack(scored.scored, plan.budget.usable)
    t4 = tick(clock, "formatting")
    timings["packing"] = elapsed_us(t3, t4)
    out = emit_stage(plan, scored.scored, result, counter, nonce=chosen, lines=lines, verify=policy.verify_format,
                     breakpoints=req.options.cache_breakpoints)
    # What a usage report's ratio is taken against: the same prompt by the catalog's rule alone.
    uncalibrated = out.total if calibration is None else plan.counted.renderer.count(
        out.emitted, catalog.counter(spec.family.name))
    timings["formatting"] = elapsed_us(t4, time.monotonic_ns())
    timings["total"] = sum(timings.get(k, 0) for k in STAGES)
    return response(req, retrieval, plan, scored, out, CountBasis(counter.kind, uncalibrated), timings=timings,
                    worker_id=engine.worker_id)


def summary_slot(req: AssembleRequest, retrieval: RetrievalResult, counted: Counted[Renderer],
                 nonce: Nonce) -> Slot | None:
    """The summary to place (the request's, else the one stored under ``summary_key``), framed:
    its nonce derived from its text like the memories block's from its lines, or the one given."""
    slot = summary.choose(req, retrieval.summary, counted.turns)
    if slot is None:
        return None
    key = nonce.key if nonce.key is not None else fmt.process_nonce_key()
    return summary.framed(slot, key, None if nonce.derive else nonce.value)


def scoring_stage(req: AssembleRequest, retrieval: RetrievalResult, cost: MemoryCost) -> Scored:
    """Score every copy retrieval kept, then apply the request's ``max_memories``.

    The scorer sees ``[*hot, *cold]`` and picks the copy of a repeated memory_id itself, since it
    knows which copy's scores are valid (one decision per memory, docs/assembly.md "Scoring and packing").
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


def message_edits(plan: Plan[Renderer], model: str) -> list[MessageEdit]:
    """The kept messages sent or counted other than as written: cleared, and how thinking counted."""
    turns, r, kept = plan.counted.turns, plan.counted.renderer, plan.fit.kept_indices
    cleared = context_edit.edits(plan.clearing, turns.messages, kept, r.costs)
    thinking = context_edit.thinking_edits(r.thinking, turns.messages, kept, plan.clearing, model=model)
    return sorted([*cleared, *thinking], key=lambda e: (e.index, e.action))


def response(
    req: AssembleRequest, retrieval: RetrievalResult, plan: Plan[Renderer], scored: Scored, out: Output,
    basis: CountBasis, *, timings: dict[str, int], worker_id: str,
) -> AssembleResponse:
    """The wire response, from one render: what was packed, every decision, the budget, the
    packer's stats and, for a conversation target, the messages and their count."""
    budget, result, block, chat = plan.budget, out.result, out.block, out.emitted.chat
    kept, dropped = block.kept, block.dropped
    reasons = retrieval.degraded_reasons
    # One validation pass over the whole answer: the rows of packed and decisions go in as fields.
    return AssembleResponse.model_validate({
        "request_id": req.request_id,
        "rendered": out.emitted.text.text,
        "sections": list(out.emitted.text.sections),
        "packed": [{"memory_id": m.memory_id, "category": m.hit.category, "tokens": m.tokens,
                    "score": m.composite_score, "source": m.hit.source} for m in kept],
        "decisions": decisions(retrieval, scored.rejected, kept, list(result.excluded), dropped, budget.usable),
        "budget": budget,
        "constrained": budget.constrained,
        "branches": retrieval.outcomes,
        "packer": PackerStats(
            path=result.path, evaluated=result.evaluated,
            excluded_for_budget=result.excluded_for_budget + len(dropped),
            budget_reached=result.budget_reached or bool(dropped),
            total_tokens=sum(map(_TOKENS, kept)),
            total_score=sum(map(_SCORE, kept)), token_budget=budget.usable,
        ),
        "degraded": bool(reasons),
        "degraded_reasons": reasons,
        "timings_us": timings,
        "nonce": block.nonce,
        "worker_id": worker_id,
        "org_id": req.org_id,
        "agent_id": req.agent_id,
        "history": history_decisions(plan.fit),
        "edits": message_edits(plan, budget.model),
        "summary": summary.report(plan.summary_offered, plan.summary is not None, plan.summary_tokens,
                                  plan.summary_dropped),
        "history_dropped_upto": summary.dropped_upto(plan.counted.turns, plan.fit.kept_indices),
        "format": chat.format if chat else None,
        "messages": chat.messages if chat else None,
        "system": chat.system if chat else None,
        "layout": chat.layout.wire if chat else None,
        "prompt_tokens": out.total if chat else None,
        "prompt_tokens_kind": basis.kind if chat else None,
        "prompt_tokens_uncalibrated": basis.uncalibrated if chat else None,
        "stable_prefix_tokens": plan.counted.renderer.stable_prefix(out.emitted),
        "cache_breakpoints": chat.marked if chat else [],
    })
