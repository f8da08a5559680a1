"""The provider-ready conversation from the caller's own conversation and a ``ChatLayout``.

A chat reply says which of the caller's messages are kept and what the service adds where (the
directive, the memory block, ``cache_control`` marks), never the caller's messages themselves:
the caller holds them already (docs/assembly.md "Size limits"). ``materialize`` applies a layout; the
pipeline applies it to the conversation it counted, the client library to the caller's own, so
both are the same messages and the caller's parts come back as the very objects it passed.

    materialize(layout, messages, system)   -> (messages, system)
    for_wire(response)                      the reply as sent: the layout without the messages
    restore(response, messages, system)     the reply as the caller sees it: messages rebuilt
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...shared.wire.errors import Internal
from ...shared.wire.models import AssembleResponse, ChatLayout, Piece, Placed

Message = dict[str, Any]
EPHEMERAL = {"type": "ephemeral"}


def blocks_of(content: Any) -> list[Any]:
    """A message's (or Anthropic system's) content as blocks: a string is one text block, a list
    is its blocks, anything else has none."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content) if isinstance(content, list) else []


def _pieces(pieces: Sequence[Piece], content: Any, where: str) -> list[Any]:
    blocks = blocks_of(content)
    out: list[Any] = []
    for k, piece in enumerate(pieces):
        if piece.ref is None:
            block: Any = {"type": "text", "text": piece.text}
        elif piece.ref < len(blocks):
            block = blocks[piece.ref]
        else:
            raise Internal(f"layout: {where}.{k} refers to block {piece.ref} of {len(blocks)}")
        if piece.clear is not None:
            block = cleared_block(block, piece.clear, f"{where}.{k}")
        if piece.cache:
            if not isinstance(block, dict):
                raise Internal(f"layout: {where}.{k} marks a block that is not a map")
            block = {**block, "cache_control": dict(EPHEMERAL)}
        out.append(block)
    return out


def cleared_block(block: Any, text: str, where: str) -> Any:
    """A caller's block with its payload cleared: a ``tool_result``'s content becomes ``text``, a
    ``tool_use``'s input ``{}``; every other field (ids, ``is_error``, ``cache_control``) stays."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "tool_result":
        return {**block, "content": text}
    if kind == "tool_use":
        return {**block, "input": {}}
    raise Internal(f"layout: {where} clears a block that is neither tool_result nor tool_use")


def rebuilt(item: Placed, message: Any, where: str) -> Message:
    """Caller message ``message`` as ``item`` (its ``ref``) rebuilds it: content from the pieces,
    the cleared tool calls' arguments ``"{}"``."""
    if not isinstance(message, dict):
        raise Internal(f"layout: {where} rebuilds a message that is not a map")
    out = dict(message)
    if item.content is not None:
        out["content"] = _pieces(item.content, message.get("content"), where)
    if item.cleared_calls:
        calls = message.get("tool_calls")
        if not isinstance(calls, list) or any(k >= len(calls) or not isinstance(calls[k], dict)
                                              for k in item.cleared_calls):
            raise Internal(f"layout: {where} clears a tool call the message does not have")
        cleared = frozenset(item.cleared_calls)
        out["tool_calls"] = [_call_cleared(c) if k in cleared else c for k, c in enumerate(calls)]
    return out


def _call_cleared(call: dict[str, Any]) -> dict[str, Any]:
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "arguments": "{}"}}
    if isinstance(call.get("custom"), dict):
        return {**call, "custom": {**call["custom"], "input": ""}}
    return call


def materialize(layout: ChatLayout, messages: Sequence[Any], system: Any = None
                ) -> tuple[list[Message], list[Any] | None]:
    """(messages, system) the provider is sent: ``layout`` applied to the caller's ``messages`` and
    ``system``. Kept messages and blocks are the caller's own objects; ``Internal`` when the layout
    refers to a message or block the conversation does not have (a reply for another request)."""
    out: list[Message] = []
    for i, item in enumerate(layout.messages):
        ref = item if isinstance(item, int) else item.ref
        if ref is not None and ref >= len(messages):
            raise Internal(f"layout: messages.{i} refers to message {ref} of {len(messages)}")
        if isinstance(item, int):
            out.append(messages[item])
        elif item.ref is None:
            out.append({"role": item.role, "content": item.text})
        else:
            out.append(rebuilt(item, messages[item.ref], f"messages.{i}"))
    built_system = None if layout.system is None else _pieces(layout.system, system, "system")
    return out, built_system


def for_wire(response: AssembleResponse) -> AssembleResponse:
    """The reply as a worker sends it: a chat reply's layout, without the messages it rebuilds."""
    if response.layout is None:
        return response
    return response.model_copy(update={"messages": None, "system": None})


def restore(response: AssembleResponse, messages: Sequence[Any], system: Any = None) -> AssembleResponse:
    """The reply as the caller sees it: ``messages`` and ``system`` rebuilt from the caller's own
    conversation. A chat reply without a layout (a worker that does not send one) is ``Internal``:
    its messages are the service's copy, whose images are stubs (``pipeline.counting.images``)."""
    if response.format is None:
        return response
    if response.layout is None:
        raise Internal("the chat reply has no layout to rebuild the conversation from: the worker and "
                       "the client library must be the same release")
    built, built_system = materialize(response.layout, messages, system)
    return response.model_copy(update={"messages": built, "system": built_system})
