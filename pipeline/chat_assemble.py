"""The chat-native request through the one pipeline: plan (validate, count, fit the history),
then the same scoring and packing as every request, then provider-ready messages.

Split from ``pipeline.assemble`` (which dispatches here when a request has ``format``) so both
stay small; the stages are shared, so a chat request's memories get the same decisions.
"""

from __future__ import annotations

import time

from ibex_context.pipeline import chat
from ibex_context.pipeline.assemble import (
    STAGES,
    Clock,
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
from ibex_context.pipeline.types import RetrievalResult
from ibex_context.shared.calibration import Calibration
from ibex_context.shared.catalog import Catalog
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
    for _ in range(MAX_REPACKS):
        nonce = block_nonce(req, result, lines, base_nonce, derive=derive_nonce)
        formatted = formatting_stage(planned, result, counter, nonce=nonce, lines=lines, verify=policy.verify_format)
        block = next((s.text for s in formatted.rendered.sections if s.name == "memories"), "") or None
        out = chat.render_chat(plan, retrieval.directive, block, breakpoints=req.options.cache_breakpoints)
        exact_block = (chat.memory_block_tokens(counter, formatted.kept, nonce, lines)
                       if block is not None and counter.kind == "exact" else None)
        total = chat.prompt_tokens(plan, spec, counter, out, block_tokens=exact_block)
        if total <= limit or not result.packed:
            break
        # A bound was wrong (it never has been in the tests): pack again with the overshoot removed.
        result = pack(scored.scored, max(0, result.token_budget - (total - limit)))
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


