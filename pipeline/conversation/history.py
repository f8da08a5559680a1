"""Conversation history that fits a token budget, trimmed oldest first in units that stay valid.

Pure: the caller passes the conversation in the provider's own shape (OpenAI Chat Completions
``messages``; Anthropic Messages ``messages``, whose ``system`` is a separate field the caller
budgets for) and a cost function per message; nothing here counts tokens or does I/O.

A conversation is split into **units** that stay or leave together, because a provider rejects a
tool result without its call and a call without its result:

  * OpenAI: an assistant message with ``tool_calls`` plus the ``tool`` messages answering it;
    any other message alone. The API refuses both halves alone, with "Messages with role 'tool'
    must be a response to a preceding message with 'tool_calls'" and "An assistant message with
    'tool_calls' must be followed by tool messages responding to each 'tool_call_id'" (its 400
    errors, as quoted in e.g. microsoft/promptflow#3130). system/developer messages are pinned.
  * Anthropic: an assistant message with ``tool_use`` blocks plus the next user message, which
    holds their ``tool_result`` blocks (and may carry text after them); "each tool_use block must
    have a corresponding tool_result block in the next message"
    (https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls).

**Pinned** units are never dropped: system/developer messages, and the latest user turn (the
last user message that is not only tool results) with everything after it, i.e. the agent's
current tool loop. ``min_recent_turns`` pins the last N user turns the same way.
``history_budget`` turns the usable tokens into the conversation's budget, keeping
``min_memory_share`` of them for memories (default 0: memories get what the history leaves).

Trimming drops the oldest unpinned units until the rest fits. After a trim the kept history
also starts on a user turn (``start_on_user``, on by default): an assistant reply whose question
was trimmed is dropped too, as LangChain's ``trim_messages(start_on="human")`` does
(https://reference.langchain.com/python/langchain-core/messages/utils/trim_messages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from ...shared.wire.errors import InvalidRequest

ChatFormat = Literal["openai", "anthropic"]
HistoryMode = Literal["trim_oldest", "fail"]
_FORMATS, _MODES = get_args(ChatFormat), get_args(HistoryMode)  # checked on every request
UnitKind = Literal["system", "tool_exchange", "message"]
DropReason = Literal["trim_oldest", "start_on_user", "summarized"]
OverflowReason = Literal["pinned", "fail_mode"]
Message = dict[str, Any]

REASON_TEXT: dict[DropReason, str] = {
    "trim_oldest": "dropped to fit the budget: the oldest turns that are not pinned go first",
    "start_on_user": "dropped after the trim so the kept history starts on a user turn (its question was trimmed)",
    "summarized": "replaced by the compaction summary (summary.covers)",
}


class MessageCost(Protocol):
    """Tokens one message costs as the provider counts it (another module implements it)."""

    def __call__(self, message: Message, /) -> int: ...


class HistoryOverflow(Exception):
    """The conversation cannot fit: the pinned part alone is over budget, or mode "fail" forbids trimming.

    ``needed`` is what would have to be sent (the pinned part, or the whole conversation in fail
    mode), ``available`` the budget, ``over_by`` the difference. The wiring maps it to the wire's
    overflow error code.
    """

    def __init__(self, *, needed: int, available: int, reason: OverflowReason) -> None:
        self.needed = needed
        self.available = available
        self.over_by = needed - available
        self.reason: OverflowReason = reason
        what = ("the pinned messages (system/developer and the latest user turns)" if reason == "pinned"
                else 'the conversation (history mode "fail" forbids trimming)')
        super().__init__(f"messages: {what} need {needed} tokens, {self.over_by} over the {available} available")


@dataclass(frozen=True, slots=True)
class HistoryPolicy:
    """Per-request trimming policy. Defaults: trim oldest first, pin only the latest user turn, start
    on a user turn after a trim, and reserve nothing for memories (they get what history leaves)."""

    mode: HistoryMode = "trim_oldest"
    min_recent_turns: int = 0
    start_on_user: bool = True
    min_memory_share: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise InvalidRequest(f"history.mode: must be one of {_MODES}, got {self.mode!r}",
                                 field="history.mode")
        if isinstance(self.min_recent_turns, bool) or not isinstance(self.min_recent_turns, int) \
                or self.min_recent_turns < 0:
            raise InvalidRequest(f"history.min_recent_turns: must be an integer >= 0, got {self.min_recent_turns!r}",
                                 field="history.min_recent_turns")
        share = self.min_memory_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share < 1.0:
            raise InvalidRequest(f"history.min_memory_share: must be a number in [0, 1), got {share!r}",
                                 field="history.min_memory_share")


@dataclass(frozen=True, slots=True)
class Unit:
    """Messages ``start`` to ``stop`` (exclusive) that stay or leave together."""

    id: int
    start: int
    stop: int
    kind: UnitKind


@dataclass(frozen=True, slots=True)
class HistoryDrop:
    """One dropped message: where it was, what it cost, why, and which unit took it along."""

    index: int
    role: str
    tokens: int
    reason: DropReason
    unit: int


@dataclass(frozen=True, slots=True)
class HistoryFit:
    """What is sent (the caller's own message objects, original order) and what was left out."""

    kept: tuple[Message, ...]
    kept_indices: tuple[int, ...]
    dropped: tuple[HistoryDrop, ...]
    kept_tokens: int
    dropped_tokens: int
    budget: int

    @property
    def trimmed(self) -> bool:
        return bool(self.dropped)


def _blocks(message: Message) -> list[Any]:
    """Content blocks of a message; string content has none (it is one text block)."""
    content = message.get("content")
    return content if isinstance(content, list) else []


def _has_block(message: Message, kind: str) -> bool:
    return any(isinstance(b, dict) and b.get("type") == kind for b in _blocks(message))


def is_user_turn(format: ChatFormat, message: Message) -> bool:
    """A message the user wrote: role user, and for Anthropic not only ``tool_result`` blocks."""
    if message.get("role") != "user":
        return False
    if format == "openai" or isinstance(message.get("content"), str):
        return True
    return any(not (isinstance(b, dict) and b.get("type") == "tool_result") for b in _blocks(message))


def _openai_unit(messages: Sequence[Message], i: int) -> tuple[int, UnitKind]:
    role = messages[i].get("role")
    if role in ("system", "developer"):
        return i + 1, "system"
    if role == "assistant" and messages[i].get("tool_calls"):
        stop = i + 1
        while stop < len(messages) and messages[stop].get("role") == "tool":
            stop += 1
        return stop, "tool_exchange"
    return i + 1, "message"


def _anthropic_unit(messages: Sequence[Message], i: int) -> tuple[int, UnitKind]:
    if messages[i].get("role") == "assistant" and _has_block(messages[i], "tool_use"):
        nxt = i + 1
        if nxt < len(messages) and messages[nxt].get("role") == "user" and _has_block(messages[nxt], "tool_result"):
            return nxt + 1, "tool_exchange"
        return nxt, "tool_exchange"
    return i + 1, "message"


def _check_format(format: str) -> None:
    if format not in _FORMATS:
        raise InvalidRequest(f"format: must be one of {_FORMATS}, got {format!r}", field="format")


def split_units(format: ChatFormat, messages: Sequence[Message]) -> list[Unit]:
    """The conversation as consecutive units, in order; every message is in exactly one."""
    _check_format(format)
    step = _openai_unit if format == "openai" else _anthropic_unit
    units: list[Unit] = []
    start = 0
    while start < len(messages):
        stop, kind = step(messages, start)
        units.append(Unit(len(units), start, stop, kind))
        start = stop
    return units


def latest_user_index(format: ChatFormat, messages: Sequence[Message]) -> int | None:
    """Index of the latest user turn (see ``is_user_turn``), or None when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if is_user_turn(format, messages[i]):
            return i
    return None


def pinned_units(format: ChatFormat, messages: Sequence[Message], units: Sequence[Unit],
                 min_recent_turns: int = 0) -> frozenset[int]:
    """Ids of the units never dropped: system units, and the unit holding the last ``max(1, N)``-th
    user turn with every unit after it (all user turns when there are fewer). With no user turn
    at all, the last unit is pinned so a provider never gets an empty conversation."""
    turn_units = [u.id for u in units if any(is_user_turn(format, messages[i]) for i in range(u.start, u.stop))]
    if turn_units:
        tail = turn_units[-min(max(1, min_recent_turns), len(turn_units))]
    else:
        tail = len(units) - 1 if units else 0
    return frozenset(u.id for u in units if u.kind == "system" or u.id >= tail)


def history_budget(usable_tokens: int, policy: HistoryPolicy) -> int:
    """Tokens the conversation may use out of ``usable_tokens`` (what remains after the window's
    reserves, directive and tools): all of it minus the share kept for memories, rounded in the
    memories' favour."""
    return max(0, usable_tokens - math.ceil(usable_tokens * policy.min_memory_share))


def _costs(cost: MessageCost, messages: Sequence[Message]) -> list[int]:
    out: list[int] = []
    for i, message in enumerate(messages):
        tokens = cost(message)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"messages.{i}: the cost function returned {tokens!r}, not a token count >= 0")
        out.append(tokens)
    return out


def _trim(units: Sequence[Unit], unit_cost: Sequence[int], pinned: frozenset[int],
          excess: int) -> dict[int, DropReason]:
    """Oldest unpinned units first until ``excess`` tokens are gone (the caller checked it can be)."""
    drops: dict[int, DropReason] = {}
    for unit in units:
        if excess <= 0:
            break
        if unit.id not in pinned:
            drops[unit.id] = "trim_oldest"
            excess -= unit_cost[unit.id]
    return drops


def _start_on_user(format: ChatFormat, messages: Sequence[Message], units: Sequence[Unit],
                   pinned: frozenset[int], drops: dict[int, DropReason]) -> None:
    """Drop unpinned units until the first kept non-system unit opens with a user turn."""
    for unit in units:
        if unit.id in drops or unit.kind == "system":
            continue
        if unit.id in pinned or is_user_turn(format, messages[unit.start]):
            return
        drops[unit.id] = "start_on_user"


def fit_history(format: ChatFormat, messages: Sequence[Message], *, cost: MessageCost, budget: int,
                policy: HistoryPolicy | None = None) -> HistoryFit:
    """Keep as much of the conversation as fits in ``budget`` tokens, dropping oldest units first.

    ``cost(message)`` is called once per message; the kept messages' costs sum to at most
    ``budget``. Raises ``HistoryOverflow`` when the pinned part alone exceeds ``budget``, or when
    ``policy.mode`` is "fail" and anything would have to go.
    """
    policy = policy or HistoryPolicy()
    _check_format(format)
    costs = _costs(cost, messages)
    total = sum(costs)
    if total <= budget:  # it all fits: nothing to pin or drop (the common case, so no units are built)
        return HistoryFit(kept=tuple(messages), kept_indices=tuple(range(len(messages))), dropped=(),
                          kept_tokens=total, dropped_tokens=0, budget=budget)
    units = split_units(format, messages)
    unit_cost = [sum(costs[u.start:u.stop]) for u in units]
    pinned = pinned_units(format, messages, units, policy.min_recent_turns)
    pinned_tokens = sum(unit_cost[i] for i in pinned)
    if pinned_tokens > budget:
        raise HistoryOverflow(needed=pinned_tokens, available=budget, reason="pinned")
    if total > budget and policy.mode == "fail":
        raise HistoryOverflow(needed=total, available=budget, reason="fail_mode")
    drops = _trim(units, unit_cost, pinned, total - budget)
    if drops and policy.start_on_user:
        _start_on_user(format, messages, units, pinned, drops)
    kept = [i for u in units if u.id not in drops for i in range(u.start, u.stop)]
    dropped = tuple(HistoryDrop(i, str(messages[i].get("role")), costs[i], reason, uid)
                    for uid, reason in sorted(drops.items()) for i in range(units[uid].start, units[uid].stop))
    kept_tokens = sum(costs[i] for i in kept)
    return HistoryFit(kept=tuple(messages[i] for i in kept), kept_indices=tuple(kept), dropped=dropped,
                      kept_tokens=kept_tokens, dropped_tokens=total - kept_tokens, budget=budget)
