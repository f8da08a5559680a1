"""Provider-ready output: the kept conversation with the directive and the memory block placed in it.

Pure and deterministic: the caller's message and block objects pass through as the same objects
(images, tool calls and ``cache_control`` untouched); only the directive and memory block become
new messages or blocks. Empty or absent text adds nothing (Anthropic refuses empty text blocks).

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
from typing import Any, Literal

from ibex_context.pipeline.history import Message, latest_user_index
from ibex_context.shared.errors import InvalidRequest

SystemRole = Literal["system", "developer"]
SYSTEM_ROLES: tuple[SystemRole, ...] = ("system", "developer")


def _leading_system_count(messages: Sequence[Message]) -> int:
    count = 0
    while count < len(messages) and messages[count].get("role") in SYSTEM_ROLES:
        count += 1
    return count


def render_openai(kept_messages: Sequence[Message], *, directive: str | None, memory_block: str | None,
                  system_role: SystemRole = "system") -> list[Message]:
    """Chat Completions ``messages``: leading system messages, directive, history, memory block,
    latest user turn and what follows it. ``system_role`` is the role of the two added messages."""
    if system_role not in SYSTEM_ROLES:
        raise InvalidRequest(f"system_role: must be one of {SYSTEM_ROLES}, got {system_role!r}", field="system_role")
    out: list[Message] = list(kept_messages)
    latest = latest_user_index("openai", out)
    memory_at = len(out) if latest is None else latest
    directive_at = _leading_system_count(out)
    # Insert at the later position first so the earlier index stays valid (memory_at >= directive_at:
    # a user message is never a leading system message).
    if memory_block:
        out.insert(memory_at, {"role": system_role, "content": memory_block})
    if directive:
        out.insert(directive_at, {"role": system_role, "content": directive})
    return out


def _system_blocks(system: str | Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The caller's ``system`` as text blocks: a string becomes one block, a list passes through."""
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"type": "text", "text": system}]
    return list(system)


def _with_block_first(message: Message, text: str) -> Message:
    """A copy of ``message`` with a text block placed first, after its leading ``tool_result`` blocks
    (Anthropic requires tool results to come first in a user message's content)."""
    content = message.get("content")
    blocks: list[Any] = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    at = 0
    while at < len(blocks) and isinstance(blocks[at], dict) and blocks[at].get("type") == "tool_result":
        at += 1
    blocks.insert(at, {"type": "text", "text": text})
    return {**message, "content": blocks}


def render_anthropic(system: str | Sequence[dict[str, Any]] | None, kept_messages: Sequence[Message], *,
                     directive: str | None, memory_block: str | None) -> tuple[list[dict[str, Any]], list[Message]]:
    """Messages API ``(system, messages)``: system blocks are the caller's then the directive; the
    memory block is a text block at the start of the latest user turn (in ``system``, last, when
    there is no user turn). Every other message passes through as the same object."""
    blocks = _system_blocks(system)
    if directive:
        blocks.append({"type": "text", "text": directive})
    out: list[Message] = list(kept_messages)
    if memory_block:
        latest = latest_user_index("anthropic", out)
        if latest is None:
            blocks.append({"type": "text", "text": memory_block})
        else:
            out[latest] = _with_block_first(out[latest], memory_block)
    return blocks, out


MAX_BREAKPOINTS = 4  # Anthropic: "you can define up to 4 cache breakpoints"
_UNCACHEABLE = ("thinking", "redacted_thinking")


def _has_breakpoint(block: Any) -> bool:
    return isinstance(block, dict) and "cache_control" in block


def _caller_breakpoints(system: Sequence[dict[str, Any]], messages: Sequence[Message],
                        tools: Sequence[dict[str, Any]]) -> int:
    in_messages = sum(_has_breakpoint(b) for m in messages if isinstance(m.get("content"), list)
                      for b in m["content"])
    return sum(map(_has_breakpoint, system)) + in_messages + sum(map(_has_breakpoint, tools))


def add_breakpoints(system: list[dict[str, Any]], messages: list[Message], tools: Sequence[dict[str, Any]]
                    ) -> list[str]:
    """Mark ``{"type": "ephemeral"}`` after the stable parts, in place on copies of the blocks.

    The last system block (tools and system are then one cached prefix) and the last content block
    of the message just before the latest user turn (the whole earlier conversation). Anthropic
    allows four breakpoints per request, the caller's own included: with three or more already
    used only what fits is added (the system one first). No user turn: nothing is marked. Returns
    the paths marked.
    """
    latest = latest_user_index("anthropic", messages)
    if latest is None:  # the memory block is then the last system block: nothing stable to mark
        return []
    room = MAX_BREAKPOINTS - _caller_breakpoints(system, messages, tools)
    targets: list[tuple[str, list[Any], int]] = []
    if system:
        targets.append(("system", system, len(system) - 1))
    if latest > 0:
        before = messages[latest - 1]
        content = before.get("content")
        blocks: list[Any] = [{"type": "text", "text": content}] if isinstance(content, str) and content else \
            list(content) if isinstance(content, list) else []
        if blocks:
            messages[latest - 1] = {**before, "content": blocks}
            targets.append((f"messages.{latest - 1}.content", blocks, len(blocks) - 1))
    marked: list[str] = []
    for prefix, blocks, i in targets:
        block = blocks[i]
        if room <= 0 or not isinstance(block, dict) or block.get("type") in _UNCACHEABLE or _has_breakpoint(block):
            continue
        blocks[i] = {**block, "cache_control": {"type": "ephemeral"}}
        marked.append(f"{prefix}.{i}")
        room -= 1
    return marked
