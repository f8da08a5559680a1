"""Clear before drop: old tool results replaced by a short placeholder before any whole turn goes.

Modeled on Anthropic's ``clear_tool_uses_20250919`` context-editing strategy (``trigger``, ``keep``,
``clear_at_least``, ``exclude_tools``, ``clear_tool_inputs``;
https://docs.claude.com/en/docs/build-with-claude/context-editing) and LangChain's
``ContextEditingMiddleware`` / ``ClearToolUsesEdit``, run here before the history is fitted:

    plan(format, messages, costs, policy=, budget=, recount=)  -> Clearing   (what to clear, new costs)
    apply(layout, clearing, messages, format)                  -> ChatLayout (the edits in a render)
    edits(clearing, messages, kept_indices, costs)             -> [MessageEdit] (the reply's ``cleared``)

Rules (docs/assembly.md "Context editing"):

  * Active when the conversation's cost is over the budget it may use, or over ``trigger_tokens``;
    it then sets out to clear the excess rounded up to a multiple of the step: ``clear_at_least``
    (K), or ``step_share`` of the limit when that is more. The rounding is what keeps the prompt
    cache: the set cleared is a function of the excess, and it only changes when the excess crosses
    a multiple of the step, so the calls in between send the same bytes (a stateless hysteresis:
    after a clearing the prompt sits up to a step under the limit). When everything that may be
    cleared saves less than K, nothing is cleared (as Anthropic's strategy does) and the trim drops
    turns instead.
  * Oldest tool use first (the order of the calls). The last ``keep`` tool uses (counted over all
    tools), tools in ``exclude_tools`` and a result whose placeholder would not be smaller are
    never cleared. A cleared use keeps its call and its result block, ids intact, so every
    tool_use still has its tool_result in both forms; only the result's content becomes the
    placeholder (and, with ``clear_tool_inputs``, the call's input ``{}``).
  * ``clear_thinking`` (Anthropic): the thinking blocks of assistant messages before the latest
    user turn are removed, oldest first with the tool uses; the API allows leaving out earlier
    turns' thinking, never the current tool loop's, which is never touched (a signed block cannot
    be edited, only left out). A message that would be left with no block keeps its thinking.
  * The placeholder is data, not instructions: fixed wording, the tool's name reduced to
    ``[A-Za-z0-9_.-]`` (at most 64) and the cleared size in characters (not tokens, so a changed
    calibration never changes its bytes): ``[tool result cleared to save context: NAME, 1234
    characters]``.

Pure and deterministic: the same messages, costs and policy give the same edits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...shared.wire.editing import ContextEditing, MessageEdit
from ...shared.wire.models import ChatFormat, ChatLayout, Piece, Placed
from ..counting.chat_count import THINKING_KINDS, canonical_json, latest_turn
from .layout import blocks_of, rebuilt

Message = dict[str, Any]
Recount = Callable[[int, Message], int]  # tokens of message i as edited, by the target's rules
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


@dataclass(frozen=True, slots=True)
class ClearPolicy:
    """The request's ``history.context_editing`` as the planner reads it."""

    enabled: bool = True
    trigger_tokens: int | None = None
    keep: int = 3
    clear_at_least: int = 1024
    exclude_tools: frozenset[str] = frozenset()
    clear_tool_inputs: bool = False
    clear_thinking: bool = False
    step_share: float = 0.5

    @classmethod
    def of(cls, options: ContextEditing) -> ClearPolicy:
        return cls(options.enabled, options.trigger_tokens, options.keep, options.clear_at_least,
                   frozenset(options.exclude_tools), options.clear_tool_inputs, options.clear_thinking,
                   options.step_share)

    def step(self, limit: int) -> int:
        """Tokens the excess is rounded up to a multiple of: ``clear_at_least``, or ``step_share`` of
        what the conversation may use when that is more (the cleared boundary then stays put while
        the next calls append up to that much)."""
        return max(self.clear_at_least, int(limit * self.step_share))


@dataclass(frozen=True, slots=True)
class ToolUse:
    """One call and its result: the call's message and place (Anthropic block, OpenAI tool_calls
    index), the result's message and block (None: an OpenAI ``tool`` message, all of it)."""

    id: str
    name: str
    call: int
    call_at: int
    result: int
    result_at: int | None


@dataclass(slots=True)
class Edit:
    """How one caller message is changed: result blocks -> placeholder (key -1: an OpenAI tool
    message's whole content), inputs emptied, thinking blocks removed; the tools named."""

    results: dict[int, str] = field(default_factory=dict)
    inputs: set[int] = field(default_factory=set)
    thinking: set[int] = field(default_factory=set)
    tools: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Clearing:
    """What the planner decided: the edits by caller message index, every message's cost after
    them, the tokens they save, the tokens it set out to clear (0: not active), and why nothing
    was cleared although it was active."""

    edits: Mapping[int, Edit]
    costs: tuple[int, ...]
    saved: int = 0
    target: int = 0
    note: str | None = None


def none(costs: Sequence[int], *, target: int = 0, note: str | None = None) -> Clearing:
    return Clearing({}, tuple(costs), 0, target, note)


def tool_name(name: Any) -> str:
    """A tool's name as a placeholder shows it: ``[A-Za-z0-9_.-]``, at most 64, never empty."""
    text = _NAME_UNSAFE.sub("_", name if isinstance(name, str) else "")[:64]
    return text or "tool"


def placeholder(name: Any, chars: int, *, inputs: bool) -> str:
    what = "tool result and input" if inputs else "tool result"
    return f"[{what} cleared to save context: {tool_name(name)}, {chars} characters]"


def _chars(content: Any) -> int:
    if content is None:
        return 0
    return len(content) if isinstance(content, str) else len(canonical_json(content))


def tool_uses(format: ChatFormat, messages: Sequence[Message]) -> list[ToolUse]:
    """Every answered tool use, in call order (message, then place in it)."""
    uses: list[ToolUse] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if format == "openai":
            results: dict[Any, int] = {}
            j = i + 1
            while j < len(messages) and messages[j].get("role") == "tool":
                results.setdefault(messages[j].get("tool_call_id"), j)
                j += 1
            for k, call in enumerate(m.get("tool_calls") or ()):
                if not isinstance(call, dict):
                    continue
                body = call.get("function") or call.get("custom") or {}
                at = results.get(call.get("id"))
                if at is not None:
                    uses.append(ToolUse(str(call.get("id")), str(body.get("name") or ""), i, k, at, None))
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) and messages[i + 1].get("role") == "user" else None
        found = {b.get("tool_use_id"): k for k, b in enumerate(blocks_of(nxt.get("content")) if nxt else ())
                 if isinstance(b, dict) and b.get("type") == "tool_result"}
        for k, b in enumerate(blocks_of(m.get("content"))):
            if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("id") in found:
                uses.append(ToolUse(str(b.get("id")), str(b.get("name") or ""), i, k, i + 1, found[b.get("id")]))
    return uses


def placed(format: ChatFormat, message: Message, index: int, edit: Edit,
           pieces: Sequence[Piece] | None = None) -> Placed:
    """The layout item that applies ``edit`` to caller message ``index`` (on ``pieces``: the
    content a render already rebuilt it from, else the message's own blocks)."""
    if format == "openai":
        if -1 in edit.results:
            return Placed(ref=index, content=[Piece(text=edit.results[-1])])
        return Placed(ref=index, cleared_calls=sorted(edit.inputs))
    base = list(pieces) if pieces is not None else [Piece(ref=j) for j in range(len(blocks_of(message.get("content"))))]
    out: list[Piece] = []
    for p in base:
        if p.ref is not None and p.ref in edit.thinking:
            continue
        if p.ref is not None and p.ref in edit.results:
            p = p.model_copy(update={"clear": edit.results[p.ref]})
        elif p.ref is not None and p.ref in edit.inputs:
            p = p.model_copy(update={"clear": ""})
        out.append(p)
    return Placed(ref=index, content=out)


def edited(format: ChatFormat, message: Message, index: int, edit: Edit) -> Message:
    """The message as the provider is sent it with ``edit`` applied (the renders' own rebuild)."""
    return rebuilt(placed(format, message, index, edit), message, f"messages.{index}")


def plan(format: ChatFormat, messages: Sequence[Message], costs: Sequence[int], *, policy: ClearPolicy,
         budget: int, recount: Recount, skip: frozenset[int] = frozenset()) -> Clearing:
    """What to clear so the conversation (less the messages in ``skip``: a summary's) fits ``budget``
    and stays under ``policy.trigger_tokens`` (module docstring); ``costs`` per message, ``recount``
    the cost of an edited one."""
    if not policy.enabled:
        return none(costs)
    total = sum(c for i, c in enumerate(costs) if i not in skip)
    limit = budget if policy.trigger_tokens is None else min(budget, policy.trigger_tokens)
    if total <= limit:
        return none(costs)
    k = policy.clear_at_least
    step = policy.step(limit)
    target = -(-(total - limit) // step) * step if step else total - limit
    uses = [u for u in tool_uses(format, messages) if u.call not in skip]
    clearable = uses[:max(0, len(uses) - policy.keep)]
    order: list[tuple[int, int, ToolUse | None]] = [(u.call, 1, u) for u in clearable
                                                    if u.name not in policy.exclude_tools]
    if policy.clear_thinking and format == "anthropic":
        latest = latest_turn(messages)
        order += [(i, 0, None) for i in range(latest or 0) if i not in skip and _thinking_removable(messages[i])]
    edits: dict[int, Edit] = {}
    now = list(costs)
    saved = 0
    for at, _, use in sorted(order, key=lambda c: (c[0], c[1], c[2].call_at if c[2] else -1)):
        if saved >= target:
            break
        trial = {i: _copy(edits.get(i)) for i in _touched(at, use, policy)}
        if use is None:
            content = blocks_of(messages[at].get("content"))
            trial[at].thinking |= {j for j, b in enumerate(content)
                                   if isinstance(b, dict) and b.get("type") in THINKING_KINDS}
        else:
            _clear_use(format, messages, use, trial, policy)
        new = {i: recount(i, edited(format, messages[i], i, e)) for i, e in trial.items()}
        gain = sum(now[i] - n for i, n in new.items())
        if gain <= 0:  # a placeholder no smaller than what it replaces: left as it is
            continue
        edits.update(trial)
        for i, n in new.items():
            now[i] = n
        saved += gain
    if k and saved < k:
        return none(costs, target=target, note=f"not cleared: what may be cleared saves {saved} tokens, "
                                               f"under clear_at_least ({k})")
    return Clearing(edits, tuple(now), saved, target)


def _thinking_removable(message: Message) -> bool:
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, list):
        return False
    thinking = sum(1 for b in content if isinstance(b, dict) and b.get("type") in THINKING_KINDS)
    return 0 < thinking < len(content)


def _copy(edit: Edit | None) -> Edit:
    if edit is None:
        return Edit()
    return Edit(dict(edit.results), set(edit.inputs), set(edit.thinking), list(edit.tools))


def _touched(at: int, use: ToolUse | None, policy: ClearPolicy) -> list[int]:
    if use is None:
        return [at]
    return sorted({use.result, use.call} if policy.clear_tool_inputs else {use.result})


def _clear_use(format: ChatFormat, messages: Sequence[Message], use: ToolUse, trial: dict[int, Edit],
               policy: ClearPolicy) -> None:
    result = messages[use.result]
    if use.result_at is None:
        content = result.get("content")
        trial[use.result].results[-1] = placeholder(use.name, _chars(content), inputs=policy.clear_tool_inputs)
    else:
        block = blocks_of(result.get("content"))[use.result_at]
        trial[use.result].results[use.result_at] = placeholder(use.name, _chars(block.get("content")),
                                                               inputs=policy.clear_tool_inputs)
    trial[use.result].tools.append(tool_name(use.name))
    if policy.clear_tool_inputs:
        trial[use.call].inputs.add(use.call_at)


def apply(layout: ChatLayout, clearing: Clearing | None, messages: Sequence[Message],
          format: ChatFormat) -> ChatLayout:
    """``layout`` with the clearing's edits on the caller messages it keeps (pieces a render
    already placed, such as the memory block, stay where they are)."""
    if clearing is None or not clearing.edits:
        return layout
    items: list[int | Placed] = []
    for item in layout.messages:
        ref = item if isinstance(item, int) else item.ref
        edit = clearing.edits.get(ref) if ref is not None else None
        if edit is None or ref is None:
            items.append(item)
            continue
        pieces = item.content if isinstance(item, Placed) else None
        items.append(placed(format, messages[ref], ref, edit, pieces))
    return layout.model_copy(update={"messages": items})


def edits(clearing: Clearing | None, messages: Sequence[Message], kept: Sequence[int],
          costs: Sequence[int]) -> list[MessageEdit]:
    """A ``cleared`` entry per kept message the clearing changed, with the tokens it saves."""
    if clearing is None or not clearing.edits:
        return []
    out: list[MessageEdit] = []
    for i in kept:
        edit = clearing.edits.get(i)
        if edit is None:
            continue
        parts = []
        if edit.results:
            parts.append(f"{len(edit.results)} tool result(s) of {', '.join(edit.tools)} replaced by a placeholder")
        if edit.inputs:
            parts.append(f"{len(edit.inputs)} tool input(s) emptied")
        if edit.thinking:
            parts.append(f"{len(edit.thinking)} thinking block(s) of an earlier turn left out")
        out.append(MessageEdit(index=i, role=str(messages[i].get("role")), action="cleared",
                               tokens=max(0, costs[i] - clearing.costs[i]),
                               reason="cleared before any turn is dropped: " + "; ".join(parts)))
    return out


def thinking_edits(thinking: Sequence[tuple[int, bool]], messages: Sequence[Message], kept: Sequence[int],
                   clearing: Clearing | None, *, model: str) -> list[MessageEdit]:
    """How each kept message's thinking was counted (Anthropic; ``chat_count``'s module docstring):
    zero for an earlier turn's on a model the API strips it for, else in full."""
    if not thinking:
        return []
    out: list[MessageEdit] = []
    latest = latest_turn(messages)
    for i in kept:
        tokens, free = thinking[i]
        edit = clearing.edits.get(i) if clearing is not None else None
        if tokens == 0 or (edit is not None and edit.thinking):
            continue
        if free:
            reason = ("thinking of an earlier turn: the provider leaves it out of the context window, "
                      "so it counts zero (sent as given)")
        elif latest is not None and i > latest:
            reason = "thinking of the current tool loop: passed back unmodified and counted in full"
        else:
            reason = (f"thinking counted in full: {model} keeps earlier turns' thinking in its context "
                      "(or is not known to strip it)")
        out.append(MessageEdit(index=i, role=str(messages[i].get("role")),
                               action="thinking_free" if free else "thinking_counted", tokens=tokens, reason=reason))
    return out
