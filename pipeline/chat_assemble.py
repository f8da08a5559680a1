"""The chat-native request through the one pipeline: plan (validate, count, fit the history),
then the same scoring and packing as every request, then provider-ready messages.

Split from ``pipeline.assemble`` (which dispatches here when a request has ``format``) so both
stay small; the stages are shared, so a chat request's memories get the same decisions.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ibex_context.pipeline import chat
from ibex_context.pipeline.assemble import (
    STAGES,
    Clock,
    Formatted,
    Planned,
    Policy,
    _tick,
    _us,
    block_nonce,
    formatting_stage,
    response,
    score_and_pack,
)
from ibex_context.pipeline.budget import counter_for
from ibex_context.pipeline.count import LineCache
from ibex_context.pipeline.pack import pack
from ibex_context.pipeline.types import PackResult, RetrievalResult
from ibex_context.shared.calibration import Calibration
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import Internal
from ibex_context.shared.models import AssembleRequest, AssembleResponse

MAX_REPACKS = 3


def assemble_chat(
    req: AssembleRequest, retrieval: RetrievalResult, *, catalog: Catalog, policy: Policy, nonce: str,
    clock: Clock | None, lines: LineCache | None, timings: dict[str, int], worker_id: str, derive_nonce: bool = True,
    calibration: Calibration | None = None,
) -> AssembleResponse:
    """``pipeline.assemble.assemble`` for a request with ``format``."""
    spec = catalog.model(req.model)
    counter = counter_for(catalog, spec, calibration)
    t = _tick(clock, "budget")
    plan, mem_text = chat.plan_chat(req, spec, counter, retrieval.directive, nonce=nonce,
                                    reserve_fraction=policy.reserve_fraction,
                                    constrained_below=policy.constrained_below, calibration=calibration)
    planned = Planned(chat.directive_section(counter, retrieval.directive), chat.flat_sections(), mem_text,
                      plan.budget)
    timings["budget"] = _us(t, _tick(clock, "scoring"))
    scored, result, t4 = score_and_pack(req, retrieval, counter, lines, plan.budget.usable, clock, timings)
    limit = spec.context_window - plan.budget.response_reserve
    base_nonce = nonce

    def emit(result: PackResult) -> tuple[str, Formatted, chat.ChatRender, int]:
        n = block_nonce(req, result, lines, base_nonce, derive=derive_nonce)
        formatted = formatting_stage(planned, result, counter, nonce=n, lines=lines, verify=policy.verify_format)
        block = next((s.text for s in formatted.rendered.sections if s.name == "memories"), "") or None
        out = chat.render_chat(plan, retrieval.directive, block, breakpoints=req.options.cache_breakpoints)
        exact_block = (chat.memory_block_tokens(counter, formatted.kept, n, lines)
                       if block is not None and counter.kind == "exact" else None)
        return n, formatted, out, chat.prompt_tokens(plan, spec, counter, out, block_tokens=exact_block)

    nonce, formatted, out, total = emit(result)
    for _ in range(MAX_REPACKS):
        if total <= limit or not result.packed:
            break
        # A bound was wrong (it never has been in the tests): pack again with the overshoot removed.
        result = pack(scored.scored, max(0, result.token_budget - (total - limit)))
        nonce, formatted, out, total = emit(result)
    while total > limit and result.packed:  # the repacks did not converge: drop the lowest-valued memory
        result = without_lowest(result)
        nonce, formatted, out, total = emit(result)
    if total > limit:
        raise Internal(f"the emitted prompt counts {total} tokens, over the {limit} the window allows, "
                       "with no memories left to drop")
    # What a usage report's ratio is taken against: the same prompt by the catalog's rule alone.
    uncalibrated = total if calibration is None else chat.prompt_tokens(
        plan, spec, catalog.counter(spec.family.name), out)
    timings["formatting"] = _us(t4, time.monotonic_ns())
    timings["total"] = sum(timings.get(k, 0) for k in STAGES)
    resp = response(req, retrieval, planned, scored, result, formatted, timings=timings, nonce=nonce,
                    worker_id=worker_id)
    return resp.model_copy(update={
        "format": plan.conversation.format, "messages": out.messages, "system": out.system,
        "layout": out.layout.wire, "prompt_tokens": total, "prompt_tokens_kind": counter.kind,
        "prompt_tokens_uncalibrated": uncalibrated, "history": chat.history_decisions(plan.fit),
        "stable_prefix_tokens": chat.stable_prefix_tokens(plan, spec, counter, out),
        "cache_breakpoints": out.marked})




def without_lowest(result: PackResult) -> PackResult:
    """``result`` with its lowest-scored packed memory moved to the excluded ones."""
    victim = min(result.packed, key=lambda m: (m.composite_score, m.memory_id))
    packed = tuple(m for m in result.packed if m is not victim)
    return replace(result, packed=packed, excluded=(*result.excluded, victim),
                   excluded_for_budget=result.excluded_for_budget + 1, budget_reached=True,
                   total_tokens=sum(m.tokens for m in packed), total_score=sum(m.composite_score for m in packed))
