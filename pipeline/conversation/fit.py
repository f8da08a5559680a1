"""The fit stage: the conversation's history into the window, then the memories' budget.

Every fixed part is counted by the target's renderer (tools, reply priming, the directive as the
target sends it, the memories block's frame). The history gets what the window leaves
(``pipeline.conversation.history``: oldest whole units first, system messages and the latest user turn
never); if even those do not fit, ``ContextOverflow`` naming how many tokens over. The packer
then spends what the kept history leaves (docs/assembly.md "Budget and token counting").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ...shared.wire.errors import ContextOverflow
from ...shared.wire.models import BudgetBreakdown, HistoryDecision, HistoryOptions
from ..budget.catalog import ModelSpec
from ..budget.usable import compute_budget, room
from ..counting.calibration import Calibration
from ..counting.count import CountedSection, directive_counted, memory_overhead
from ..counting.tokens import TokenCount, TokenCounter
from ..types import Turns
from . import context_edit
from .context_edit import Clearing, ClearPolicy
from .history import (
    REASON_TEXT,
    HistoryFit,
    HistoryOverflow,
    HistoryPolicy,
    Message,
    fit_history,
    history_budget,
)
from .summary import Slot, fit_rest, non_system


class TargetCosts(Protocol):
    """What the fit stage reads of a target's renderer (``pipeline.rendering.render.Renderer`` is one):
    the conversation's messages one by one (``costs``), what the target sends whatever history is
    kept (``fixed``, of which ``tools`` is tool definitions), and the cost of each part it places."""

    @property
    def costs(self) -> tuple[int, ...]: ...

    @property
    def fixed(self) -> int: ...

    @property
    def tools(self) -> int: ...

    def recount(self, i: int, message: Message) -> int:
        """Tokens of conversation message ``i`` as context editing changed it, by this target's rules."""
        ...

    def directive_tokens(self, directive: str | None, directive_text: CountedSection) -> int:
        """The directive as this target sends it (``directive_text``: its flat section, counted once)."""
        ...

    def frame_tokens(self, directive_text: CountedSection) -> int:
        """What this target adds around the memories block beyond its flat text (its own message
        or block; the joins between the flat sections)."""
        ...

    def summary_tokens(self, summary: str) -> int:
        """What the framed compaction summary adds as this target places it (at most)."""
        ...


R = TypeVar("R", bound=TargetCosts, covariant=True)


@dataclass(frozen=True, slots=True)
class Counted(Generic[R]):
    """A request's conversation with the renderer that emits it, which holds its counts."""

    turns: Turns
    renderer: R


@dataclass(frozen=True, slots=True)
class Plan(Generic[R]):
    """The fit stage's output: what of the conversation is sent, the budget left for memories,
    the directive (and its flat text), the memories block's flat frame (``memory_overhead``), and
    the compaction summary: the one placed (None when none is, or it was dropped), its tokens as
    charged, when dropped, why, and the one offered (placed or not, for the reply's report)."""

    counted: Counted[R]
    fit: HistoryFit
    budget: BudgetBreakdown
    directive: str | None
    directive_text: CountedSection
    memory_overhead: int
    summary: Slot | None = None
    summary_tokens: int = 0
    summary_dropped: str | None = None
    summary_offered: Slot | None = None
    clearing: Clearing | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    reserve_fraction: float
    constrained_below: int
    calibration: Calibration | None


def fit_stage(counted: Counted[R], options: HistoryOptions, directive: str | None, spec: ModelSpec,
              counter: TokenCounter, *, nonce: str, limits: Limits, summary: Slot | None = None) -> Plan[R]:
    """Fit the history, then budget the memories with the kept history's cost.

    With a ``summary`` (framed, its ``covers`` checked) the covered messages go first and the
    summary's cost comes off the history's budget; if the rest that cannot be dropped does not fit
    with it, the summary is dropped (reported) and the whole conversation fitted without it.
    """
    r = counted.renderer
    mem_text = memory_overhead(counter, nonce)
    directive_text = directive_counted(counter, directive)  # once: the budget, the joins and the plan
    frame = r.frame_tokens(directive_text) + mem_text
    fixed = (r.directive_tokens(directive, directive_text), r.fixed - r.tools, r.tools, frame)
    # everything but the history: what is left for it
    left = room(spec, sum(fixed), reserve_fraction=limits.reserve_fraction, calibration=limits.calibration)
    policy = HistoryPolicy(mode=options.mode, min_recent_turns=options.min_recent_turns,
                           min_memory_share=options.min_memory_share)
    available = history_budget(max(0, left), policy)
    placed = summary if summary is not None and summary.problem is None else None
    cost = r.summary_tokens(summary.block) if summary is not None and summary.block else 0
    clear = ClearPolicy.of(options.context_editing)
    dropped = None
    try:
        fit, clearing = _fit(counted, placed, cost, available, policy, clear)
    except HistoryOverflow as exc:
        if placed is None:
            raise _overflow(counted, spec, left, exc) from exc
        try:
            fit, clearing = _fit(counted, None, 0, available, policy, clear)
        except HistoryOverflow as exc2:
            raise _overflow(counted, spec, left, exc2) from exc2
        dropped = (f"dropped: with it the conversation needs {exc.needed} tokens that cannot be dropped "
                   f"({exc.reason}), over the {available} available for it; fitted without the summary")
        placed = None
    sent = cost if placed is not None else 0
    budget = _budget(spec, counter, fixed, fit.kept_tokens + sent, limits)
    return Plan(counted, fit, budget, directive, directive_text, mem_text,
                placed, cost, dropped, summary, clearing)


def _fit(counted: Counted[TargetCosts], summary: Slot | None, cost: int, available: int, policy: HistoryPolicy,
         clear: ClearPolicy) -> tuple[HistoryFit, Clearing]:
    """The history fitted into what is ``available``, less the summary's ``cost`` when it is placed:
    old tool uses cleared first (``pipeline.conversation.context_edit``), then whole units dropped."""
    turns, r = counted.turns, counted.renderer
    skip = frozenset(non_system(turns)[:summary.covers]) if summary is not None else frozenset()
    clearing = (context_edit.plan(turns.format, turns.messages, r.costs, policy=clear,
                                  budget=max(0, available - cost), recount=r.recount, skip=skip)
                if turns.target != "text" else context_edit.none(r.costs))
    return _fit_history(counted, summary, cost, available, policy, clearing.costs), clearing


def _fit_history(counted: Counted[TargetCosts], summary: Slot | None, cost: int, available: int, policy: HistoryPolicy,
                 costs: tuple[int, ...]) -> HistoryFit:
    turns = counted.turns
    where = {id(m): i for i, m in enumerate(turns.messages)}

    def message_cost(m: Message) -> int:
        return costs[where[id(m)]]

    if summary is None:
        return fit_history(turns.format, turns.messages, cost=message_cost, budget=available, policy=policy)
    if cost > available:
        raise HistoryOverflow(needed=cost, available=available, reason="pinned")
    try:
        return fit_rest(turns, summary.covers, cost=message_cost, budget=available - cost, policy=policy)
    except HistoryOverflow as exc:  # what it needed with the summary, in the conversation's budget
        raise HistoryOverflow(needed=exc.needed + cost, available=available, reason=exc.reason) from exc


def _overflow(counted: Counted[TargetCosts], spec: ModelSpec, unclamped: int, exc: HistoryOverflow) -> ContextOverflow:
    field = counted.turns.field
    over = exc.over_by + max(0, -unclamped)
    return ContextOverflow(
        f"{field}: the conversation needs {exc.needed} tokens that cannot be dropped ({exc.reason}) but "
        f"{max(0, unclamped)} are available for it in {spec.name}'s window: {over} tokens over", field=field)


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
