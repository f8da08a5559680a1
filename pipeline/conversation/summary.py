"""The compaction summary slot (docs/assembly.md "Compaction summaries"): a summary stands in for the
conversation's first ``covers`` non-system messages, which are taken out before the history is
fitted; the summary goes where they were, framed as untrusted data like the memories block.

    check_covers(turns, covers)        -> problem or None   (a unit boundary before the latest turn)
    cover_boundaries(turns)            -> [covers, ...]     (every one check_covers accepts, one split)
    choose(req, stored, turns)         -> Slot or None      (the request's summary, else the stored one)
    framed(slot, nonce_key, nonce)     -> Slot              (its block, the text as sent)
    fit_rest(turns, covers, ...)       -> HistoryFit        (in the caller's indices, covered = "summarized")
    dropped_upto(turns, fit)           -> int               (leading non-system messages not sent)

A count rather than message ids: a conversation only grows at its end, so the first N non-system
messages stay the same messages, and a proxy knows N. System (and developer) messages are never
covered: they stay pinned where they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ...shared.wire.errors import InvalidRequest
from ...shared.wire.models import AssembleRequest, SummaryReport, SummarySlot
from .. import format as fmt
from ..types import Turns
from .history import (
    HistoryDrop,
    HistoryFit,
    HistoryPolicy,
    Message,
    MessageCost,
    fit_history,
    pinned_units,
    split_units,
)

FIELD = "summary.covers"


@dataclass(frozen=True, slots=True)
class Slot:
    """A summary to place: its text, what it covers, where it came from; ``block`` is the framed
    text once ``framed`` made it, ``problem`` why a stored one cannot be placed here."""

    text: str
    covers: int
    source: Literal["request", "stored"]
    block: str = ""
    problem: str | None = None


def _is_system(turns: Turns, message: Message) -> bool:
    return turns.format == "openai" and message.get("role") in ("system", "developer")


def non_system(turns: Turns) -> list[int]:
    """Indices of the messages ``covers`` counts (Anthropic's system is no message)."""
    return [i for i, m in enumerate(turns.messages) if not _is_system(turns, m)]


def check_covers(turns: Turns, covers: int) -> str | None:
    """What is wrong with ``covers`` for this conversation, or None.

    It may not exceed the non-system messages, reach the latest user turn (with everything after
    it, the part never dropped), or end inside a unit: an assistant tool call and its results are
    covered together or not at all. Refused rather than extended: whoever makes summaries computes
    ``covers`` from the service's own reply (``history_dropped_upto``), which always ends on a unit.
    """
    ns, field = non_system(turns), turns.field
    if covers > len(ns):
        return f"{FIELD}: {covers} is more than the {len(ns)} non-system messages of {field}"
    if covers == 0:
        return None
    last = ns[covers - 1]
    units = split_units(turns.format, turns.messages)
    pinned = pinned_units(turns.format, turns.messages, units)
    tail = min((units[u].start for u in pinned if units[u].kind != "system"), default=len(turns.messages))
    if last >= tail:
        return (f"{FIELD}: {covers} reaches {field}.{last}, in the latest user turn or after it ({field}.{tail} "
                f"on), which a summary never replaces: at most {sum(1 for i in ns if i < tail)}")
    unit = next(u for u in units if u.start <= last < u.stop)
    if last + 1 < unit.stop:
        before, through = sum(1 for i in ns if i < unit.start), sum(1 for i in ns if i < unit.stop)
        return (f"{FIELD}: {covers} ends inside the tool exchange {field}.{unit.start}-{unit.stop - 1} (a tool "
                f"call and its results are covered together or not at all): use {before} or {through}")
    return None


def cover_boundaries(turns: Turns) -> list[int]:
    """Every ``covers`` that ``check_covers`` accepts for this conversation, ascending (0 first),
    from one split into units: a count whose last covered message ends its unit and comes before
    the latest user turn. One pass, where asking ``check_covers`` of each count is one per count
    (tests/unit/test_summary_plan.py holds the two to the same answer)."""
    ns, units = non_system(turns), split_units(turns.format, turns.messages)
    pinned = pinned_units(turns.format, turns.messages, units)
    tail = min((units[u].start for u in pinned if units[u].kind != "system"), default=len(turns.messages))
    stops = {u.stop for u in units}
    return [0, *(c for c, last in enumerate(ns, 1) if last < tail and last + 1 in stops)]


def request_slot(req: AssembleRequest, turns: Turns) -> Slot | None:
    """The request's own summary, checked: ``InvalidRequest`` naming ``summary.covers``."""
    if req.summary is None:
        return None
    problem = check_covers(turns, req.summary.covers)
    if problem is not None:
        raise InvalidRequest(problem, field=FIELD)
    return Slot(req.summary.text, req.summary.covers, "request")


def choose(req: AssembleRequest, stored: SummarySlot | None, turns: Turns) -> Slot | None:
    """The request's summary, else the stored one (``summary_key``); a stored one whose ``covers``
    does not fit this conversation is kept with its problem, to be reported and not placed."""
    own = request_slot(req, turns)
    if own is not None or stored is None:
        return own
    return Slot(stored.text, stored.covers, "stored", problem=check_covers(turns, stored.covers))


def framed(slot: Slot, nonce_key: bytes, nonce: str | None) -> Slot:
    """The slot with its block: nonce ``nonce`` when given (explicit or random), else derived from
    the summary's text, so the block stays the same bytes until a new summary is made."""
    value = nonce if nonce is not None else fmt.summary_nonce(nonce_key, slot.text)
    return replace(slot, block=fmt.summary_block(slot.text, value))


def fit_rest(turns: Turns, covers: int, *, cost: MessageCost, budget: int, policy: HistoryPolicy) -> HistoryFit:
    """``fit_history`` over the messages the summary leaves, in the caller's indices; the covered
    messages are dropped as ``summarized`` (their unit -1: the summary took them)."""
    messages = turns.messages
    covered = frozenset(non_system(turns)[:covers])
    index = [i for i in range(len(messages)) if i not in covered]
    fit = fit_history(turns.format, [messages[i] for i in index], cost=cost, budget=budget, policy=policy)
    gone = [HistoryDrop(i, str(messages[i].get("role")), cost(messages[i]), "summarized", -1) for i in sorted(covered)]
    moved = [replace(d, index=index[d.index]) for d in fit.dropped]
    return replace(fit, kept_indices=tuple(index[k] for k in fit.kept_indices),
                   dropped=tuple(sorted([*gone, *moved], key=lambda d: d.index)),
                   dropped_tokens=fit.dropped_tokens + sum(d.tokens for d in gone))


def dropped_upto(turns: Turns, kept_indices: Sequence[int]) -> int:
    """How many leading non-system messages are not sent (summarized or trimmed)."""
    kept = frozenset(kept_indices)
    n = 0
    for i in non_system(turns):
        if i in kept:
            break
        n += 1
    return n


def report(slot: Slot | None, placed: bool, tokens: int, reason: str | None) -> SummaryReport | None:
    """The reply's ``summary``: ``tokens`` is its cost as charged (what it would have cost when not sent)."""
    if slot is None:
        return None
    return SummaryReport(covers=slot.covers, tokens=tokens, placed=placed, source=slot.source,
                         reason=None if placed else (slot.problem or reason))
