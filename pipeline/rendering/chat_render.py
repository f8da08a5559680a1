"""Provider-ready output: the kept conversation with the directive and the memory block placed in it.

Pure and deterministic. Each render is a ``ChatLayout`` (``shared.wire.models``): the kept caller
messages by index, and the directive, memory block and ``cache_control`` marks placed among them;
``pipeline.conversation.layout.materialize`` turns it into messages, here for counting and in the client
library from the caller's own conversation. The caller's message and block objects pass through
as the same objects (images, tool calls and ``cache_control`` untouched); only the directive and
memory block become new messages or blocks. Empty or absent text adds nothing (Anthropic refuses
empty text blocks).

Placement follows how prompt caching works: "cache hits are only possible for exact prefix
matches ... place static content like instructions and examples at the beginning of your
prompt, and put variable content, such as user-specific information, at the end"
(https://platform.openai.com/docs/guides/prompt-caching; Anthropic caches tools, system, then
messages, in that order: https://docs.claude.com/en/docs/build-with-claude/prompt-caching).
So, from most to least stable:

  * the caller's own system prompt first, unchanged, so the proxy's existing cached prefix
    survives and an edited directive invalidates only what follows it;
  * then the directive (per agent, changes rarely);
  * the memory block (changes with retrieval) as late as possible.

OpenAI: the directive is a ``system`` message (``developer`` for o-series models: "with o1
models and newer, developer messages replace the previous system messages", OpenAI API
reference for ``ChatCompletionDeveloperMessageParam``) right after the caller's leading
system/developer messages; the memory block is its own message just before the latest user
turn, so every earlier turn stays a stable prefix (at the end when there is no user turn).

Anthropic: ``system`` becomes text blocks: the caller's system, then the directive. The memory
block is a text block at the start of the latest user turn (after its ``tool_result`` blocks,
which Anthropic requires first). Why not in ``system``: Anthropic caches tools, system, then
messages, in that order, so a block in ``system`` that changes with retrieval would make the whole
conversation a cache miss on every turn; in the latest user turn, everything before that turn
(tools, system, directive, earlier turns) is the same bytes as last turn's prompt. With
``cache_breakpoints`` (``add_breakpoints``) the proxy also gets ``cache_control`` marks after those
stable parts, since Anthropic caches only up to explicit breakpoints.

The memory block itself carries a nonce derived from its lines (``format.derive_nonce``), so
when retrieval returns the same memories the block, too, is the same bytes as last turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from ...shared.wire.errors import InvalidRequest
from ...shared.wire.models import ChatLayout, Piece, Placed
from ..conversation.history import Message, latest_user_index
from ..conversation.layout import blocks_of, materialize

SystemRole = Literal["system", "developer"]
SYSTEM_ROLES: tuple[SystemRole, ...] = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Layout:
    """A render: the wire layout, and where the memory block went (the output message holding it,
    or the last system block), for the counts that stop before it; where the compaction summary
    went (its output message, and its block there when it is a block in a caller's message)."""

    wire: ChatLayout
    memory_message: int | None = None
    memory_in_system: bool = False
    summary_message: int | None = None
    summary_block: int | None = None


def _leading_system_count(messages: Sequence[Message]) -> int:
    count = 0
    while count < len(messages) and messages[count].get("role") in SYSTEM_ROLES:
        count += 1
    return count


def openai_layout(kept: Sequence[Message], indices: Sequence[int], *, directive: str | None,
                  memory_block: str | None, system_role: SystemRole = "system", summary: str | None = None) -> Layout:
    """Chat Completions ``messages``: leading system messages, directive, compaction summary,
    history, memory block, latest user turn and what follows it. ``indices`` are the kept messages'
    places in the caller's conversation; ``system_role`` is the role of the added messages."""
    if system_role not in SYSTEM_ROLES:
        raise InvalidRequest(f"system_role: must be one of {SYSTEM_ROLES}, got {system_role!r}", field="system_role")
    items: list[int | Placed] = list(indices)
    latest = latest_user_index("openai", kept)
    memory_at = len(items) if latest is None else latest
    directive_at = _leading_system_count(kept)
    # Insert at the later position first so the earlier index stays valid (memory_at >= directive_at:
    # a user message is never a leading system message); the directive goes in last, before the summary.
    memory_message = None
    if memory_block:
        items.insert(memory_at, Placed(role=system_role, text=memory_block))
        memory_message = memory_at
    added = [text for text in (summary, directive) if text]
    for text in added:
        items.insert(directive_at, Placed(role=system_role, text=text))
    memory_message = None if memory_message is None else memory_message + len(added)
    summary_message = directive_at + (1 if directive else 0) if summary else None
    return Layout(ChatLayout(messages=items), memory_message, summary_message=summary_message)


def render_openai(kept_messages: Sequence[Message], *, directive: str | None, memory_block: str | None,
                  system_role: SystemRole = "system") -> list[Message]:
    """``openai_layout``'s messages for the kept messages alone."""
    layout = openai_layout(kept_messages, range(len(kept_messages)), directive=directive,
                           memory_block=memory_block, system_role=system_role)
    return materialize(layout.wire, kept_messages)[0]


def _tool_results_first(blocks: Sequence[Any]) -> int:
    """Where a text block may go in a user message: after its leading ``tool_result`` blocks
    (Anthropic requires tool results to come first in a user message's content)."""
    at = 0
    while at < len(blocks) and isinstance(blocks[at], dict) and blocks[at].get("type") == "tool_result":
        at += 1
    return at


def anthropic_layout(system: str | Sequence[dict[str, Any]] | None, kept: Sequence[Message],
                     indices: Sequence[int], *, directive: str | None, memory_block: str | None,
                     summary: str | None = None) -> Layout:
    """Messages API ``(system, messages)``: system blocks are the caller's then the directive; the
    memory block is a text block at the start of the latest user turn (in ``system``, last, when
    there is no user turn). The compaction summary is a text block at the start of the first kept
    message when that is a user message (before the memory block when it is the latest turn too),
    else a user message of its own before it, so the turns still alternate. Every other message
    passes through as the same object."""
    pieces = [Piece(ref=k) for k in range(len(blocks_of(system)))] if system else []  # "" adds no block
    if directive:
        pieces.append(Piece(text=directive))
    items: list[int | Placed] = list(indices)
    edits: dict[int, list[Piece]] = {}

    def place(k: int, text: str) -> int:
        blocks = blocks_of(kept[k].get("content"))
        content = edits.setdefault(k, [Piece(ref=j) for j in range(len(blocks))])
        content.insert(at := _tool_results_first(blocks), Piece(text=text))
        return at

    latest = latest_user_index("anthropic", kept) if memory_block else None
    if memory_block and latest is None:
        pieces.append(Piece(text=memory_block))
    elif memory_block and latest is not None:
        place(latest, memory_block)
    in_first = bool(summary) and bool(kept) and kept[0].get("role") == "user"
    summary_block = place(0, summary) if summary and in_first else None
    for k, content in edits.items():
        items[k] = Placed(ref=indices[k], content=content)
    if summary and not in_first:
        items.insert(0, Placed(role="user", text=summary))
        latest = None if latest is None else latest + 1
    return Layout(ChatLayout(messages=items, system=pieces), latest, bool(memory_block) and latest is None,
                  0 if summary else None, summary_block)


def render_anthropic(system: str | Sequence[dict[str, Any]] | None, kept_messages: Sequence[Message], *,
                     directive: str | None, memory_block: str | None) -> tuple[list[dict[str, Any]], list[Message]]:
    """``anthropic_layout``'s ``(system, messages)`` for the kept messages alone."""
    layout = anthropic_layout(system, kept_messages, range(len(kept_messages)), directive=directive,
                              memory_block=memory_block)
    messages, blocks = materialize(layout.wire, kept_messages, system)
    return blocks or [], messages


MAX_BREAKPOINTS = 4  # Anthropic: "you can define up to 4 cache breakpoints"
_UNCACHEABLE = ("thinking", "redacted_thinking")


def _has_breakpoint(block: Any) -> bool:
    return isinstance(block, dict) and "cache_control" in block


def _marks_in(block: Any) -> int:
    """A block's own mark plus those of the blocks nested in it (a ``tool_result``'s content):
    Anthropic counts every ``cache_control`` toward its limit, wherever it sits."""
    nested = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
    return _has_breakpoint(block) + (sum(map(_has_breakpoint, nested)) if isinstance(nested, list) else 0)


def _caller_breakpoints(system: Sequence[dict[str, Any]], messages: Sequence[Message],
                        tools: Sequence[dict[str, Any]]) -> int:
    in_messages = sum(_marks_in(b) for m in messages if isinstance(m.get("content"), list)
                      for b in m["content"])
    return sum(map(_has_breakpoint, system)) + in_messages + sum(map(_has_breakpoint, tools))


def add_breakpoints(layout: Layout, system: Sequence[dict[str, Any]], messages: Sequence[Message],
                    tools: Sequence[dict[str, Any]]) -> tuple[Layout, list[str]]:
    """``layout`` with ``{"type": "ephemeral"}`` marks after the stable parts, and the paths marked;
    ``system`` and ``messages`` are what ``layout`` renders to.

    The last system block (tools and system are then one cached prefix), the last content block
    of the message just before the latest user turn (the whole earlier conversation), and the
    compaction summary's block (it stays the same while the history after it is trimmed; not when
    it is a message of its own, whose string content takes no mark). Anthropic allows four
    breakpoints per request, the caller's own included: with three or more already used only what
    fits is added, in that order. No user turn: nothing is marked.
    """
    latest = latest_user_index("anthropic", messages)
    if latest is None:  # the memory block is then the last system block: nothing stable to mark
        return layout, []
    room = MAX_BREAKPOINTS - _caller_breakpoints(system, messages, tools)
    targets: list[tuple[str, int, int, Any]] = []  # (path prefix, message or -1 for system, block, block)
    if system:
        targets.append(("system", -1, len(system) - 1, system[-1]))
    content = messages[latest - 1].get("content") if latest > 0 else None
    blocks = blocks_of(content) if content else []
    if blocks:
        targets.append((f"messages.{latest - 1}.content", latest - 1, len(blocks) - 1, blocks[-1]))
    at, k = layout.summary_message, layout.summary_block
    if at is not None and k is not None and (at, k) != (latest - 1, len(blocks) - 1):
        targets.append((f"messages.{at}.content", at, k, blocks_of(messages[at].get("content"))[k]))
    wire, marked = layout.wire, []
    for prefix, m, i, block in targets:
        if room <= 0 or not isinstance(block, dict) or block.get("type") in _UNCACHEABLE or _has_breakpoint(block):
            continue
        wire = _mark_system(wire) if m < 0 else _mark_block(wire, m, i, len(blocks_of(messages[m].get("content"))))
        marked.append(f"{prefix}.{i}")
        room -= 1
    return replace(layout, wire=wire), marked


def _marked_last(pieces: Sequence[Piece]) -> list[Piece]:
    return [*pieces[:-1], pieces[-1].model_copy(update={"cache": True})]


def _mark_system(wire: ChatLayout) -> ChatLayout:
    return wire.model_copy(update={"system": _marked_last(wire.system or [])})


def _mark_block(wire: ChatLayout, at: int, k: int, n_blocks: int) -> ChatLayout:
    """The layout with block ``k`` of output message ``at`` (a caller's message) marked."""
    item = wire.messages[at]
    if isinstance(item, int):
        item = Placed(ref=item, content=[Piece(ref=j) for j in range(n_blocks)])
    content = list(item.content or [])
    content[k] = content[k].model_copy(update={"cache": True})
    placed = item.model_copy(update={"content": content})
    return wire.model_copy(update={"messages": [*wire.messages[:at], placed, *wire.messages[at + 1:]]})
