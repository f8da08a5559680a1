"""The pipeline's input step: every request form becomes one ``Turns``, parsed and counted once.

    to_turns(request)                          -> Turns     (pure; the chat form validated strictly)
    count_turns(request, spec, counter)        -> Counted   (the renderer and every message's cost)

The simple form (``recent_messages``/``tool_schemas``) becomes an OpenAI-shaped conversation
(``{"role", "content"}`` messages, its schemas the tools) rendered as flat text; the chat-native
form (``format``) is validated by ``pipeline.conversation.parse`` and rendered for its provider. Nothing here
needs retrieval, so the worker runs it before any I/O: a bad conversation costs no Redis or
memory-service call (docs/architecture.md "Processes and data flow").
"""

from __future__ import annotations

from ...shared.wire.models import AssembleRequest
from ..budget.catalog import ModelSpec
from ..conversation.fit import Counted
from ..conversation.parse import parse_conversation, to_wire, wire_system, wire_tools
from ..conversation.summary import request_slot
from ..counting.tokens import TokenCounter
from ..types import Turns
from .anthropic import AnthropicRenderer
from .openai import OpenAIRenderer
from .render import Renderer
from .text import TextRenderer


def to_turns(req: AssembleRequest) -> Turns:
    """The request's conversation in the one form; ``InvalidRequest`` (naming the path) for a chat
    conversation its provider would refuse."""
    if req.format is None:
        return Turns("openai", "text", [{"role": m.role, "content": m.content} for m in req.recent_messages],
                     list(req.tool_schemas), field="recent_messages")
    conv = parse_conversation(req.format, list(req.messages), system=req.system, tools=list(req.tools) or None)
    return Turns(conv.format, conv.format, to_wire(conv), wire_tools(conv) or [], wire_system(conv))


def renderer_for(turns: Turns, spec: ModelSpec, counter: TokenCounter) -> Renderer:
    """The target's renderer, its counts taken (``InvalidRequest`` for a part no rule can count)."""
    if turns.target == "openai":
        return OpenAIRenderer.create(turns, spec, counter)
    if turns.target == "anthropic":
        return AnthropicRenderer.create(turns, spec, counter)
    return TextRenderer.create(turns, counter)


def count_turns(req: AssembleRequest, spec: ModelSpec, counter: TokenCounter) -> Counted[Renderer]:
    """Parse and count: everything of an assembly that needs the request alone, the request's
    summary's ``covers`` checked against its conversation (``InvalidRequest`` naming ``summary.covers``)."""
    turns = to_turns(req)
    request_slot(req, turns)
    return Counted(turns, renderer_for(turns, spec, counter))
