"""The fit stage: the conversation's history into the window, then the memories' budget.

Every fixed part is counted by the target's renderer (tools, reply priming, the directive as the
target sends it, the memories block's frame). The history gets what the window leaves
(``pipeline.history``: oldest whole units first, system messages and the latest user turn
never); if even those do not fit, ``ContextOverflow`` naming how many tokens over. The packer
then spends what the kept history leaves (README "Budget and token counting").
"""

from __future__ import annotations

from dataclasses import dataclass

from ibex_context.pipeline.budget import compute_budget
from ibex_context.pipeline.count import CountedSection, directive_counted, memory_overhead
from ibex_context.pipeline.history import (
    REASON_TEXT,
    HistoryFit,
    HistoryOverflow,
    HistoryPolicy,
    fit_history,
    history_budget,
)
from ibex_context.pipeline.render import Message
from ibex_context.pipeline.turns import Counted
from ibex_context.shared.calibration import Calibration
from ibex_context.shared.catalog import ModelSpec
from ibex_context.shared.errors import ContextOverflow
from ibex_context.shared.models import BudgetBreakdown, HistoryDecision, HistoryOptions
from ibex_context.shared.tokens import TokenCount, TokenCounter


@dataclass(frozen=True, slots=True)
class Plan:
    """The fit stage's output: what of the conversation is sent, the budget left for memories,
    the directive (and its flat text), and the memories block's flat frame (``memory_overhead``)."""

    counted: Counted
    fit: HistoryFit
    budget: BudgetBreakdown
    directive: str | None
    directive_text: CountedSection
    memory_overhead: int


@dataclass(frozen=True, slots=True)
class Limits:
    reserve_fraction: float
    constrained_below: int
    calibration: Calibration | None


def fit_stage(counted: Counted, options: HistoryOptions, directive: str | None, spec: ModelSpec,
              counter: TokenCounter, *, nonce: str, limits: Limits) -> Plan:
    """Fit the history, then budget the memories with the kept history's cost."""
    r = counted.renderer
    mem_text = memory_overhead(counter, nonce)
    frame = r.frame_tokens(directive) + mem_text
    fixed = (r.directive_tokens(directive), r.fixed - r.tools, r.tools, frame)
    probe = _budget(spec, counter, fixed, 0, limits)  # everything but the history: what is left for it
    policy = HistoryPolicy(mode=options.mode, min_recent_turns=options.min_recent_turns,
                           min_memory_share=options.min_memory_share)
    turns = counted.turns
    where = {id(m): i for i, m in enumerate(turns.messages)}
    costs = r.costs

    def cost(m: Message) -> int:
        return costs[where[id(m)]]

    try:
        fit = fit_history(turns.format, turns.messages, cost=cost,
                          budget=history_budget(max(0, probe.unclamped), policy), policy=policy)
    except HistoryOverflow as exc:
        over = exc.over_by + max(0, -probe.unclamped)
        raise ContextOverflow(
            f"{turns.field}: the conversation needs {exc.needed} tokens that cannot be dropped ({exc.reason}) but "
            f"{max(0, probe.unclamped)} are available for it in {spec.name}'s window: {over} tokens over",
            field=turns.field) from exc
    budget = _budget(spec, counter, fixed, fit.kept_tokens, limits)
    return Plan(counted, fit, budget, directive, directive_counted(counter, directive), mem_text)


def _budget(spec: ModelSpec, counter: TokenCounter, fixed: tuple[int, int, int, int], history: int,
            limits: Limits) -> BudgetBreakdown:
    """The spec's subtraction in the target's units: the directive, the history with what is sent
    whatever is kept (reply priming, a caller's system), the tools, and the memories block's frame."""
    fam, kind = counter.family, counter.kind
    directive, messages, tools, frame = fixed
    return compute_budget(
        spec,
        directive=TokenCount(directive, fam, kind),
        messages=TokenCount(history + messages, fam, kind),
        tool_schemas=TokenCount(tools, fam, kind),
        formatter_overhead=TokenCount(frame, fam, kind),
        reserve_fraction=limits.reserve_fraction,
        constrained_below=limits.constrained_below,
        calibration=limits.calibration,
    )


def history_decisions(fit: HistoryFit) -> list[HistoryDecision]:
    """The messages left out, for the response."""
    return [HistoryDecision(index=d.index, role=d.role, tokens=d.tokens,
                            reason=f"{d.reason}: {REASON_TEXT.get(d.reason, d.reason)}") for d in fit.dropped]
