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
  * the memory block (new nonce on every assembly) as late as possible.

OpenAI: the directive is a ``system`` message (``developer`` for o-series models: "with o1
models and newer, developer messages replace the previous system messages", OpenAI API
reference for ``ChatCompletionDeveloperMessageParam``) right after the caller's leading
system/developer messages; the memory block is its own message just before the latest user
turn, so every earlier turn stays a stable prefix (at the end when there is no user turn).

Anthropic: ``system`` becomes text blocks: the caller's system, the directive, then the memory
block last. The messages are untouched. Note: Anthropic's cache order puts ``system`` before
``messages``, so a memory block in ``system`` changes the prefix of the whole conversation on
every request; caching the history would need the block in the latest user message instead.
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


def render_anthropic(system: str | Sequence[dict[str, Any]] | None, kept_messages: Sequence[Message], *,
                     directive: str | None, memory_block: str | None) -> tuple[list[dict[str, Any]], list[Message]]:
    """Messages API ``(system, messages)``: system blocks are the caller's, the directive, then the
    memory block; the messages are the kept ones, as they were."""
    blocks = _system_blocks(system)
    if directive:
        blocks.append({"type": "text", "text": directive})
    if memory_block:
        blocks.append({"type": "text", "text": memory_block})
    return blocks, list(kept_messages)
