"""Conversations in the provider's own shape: one entry point that validates an OpenAI or
Anthropic conversation strictly and returns it typed, and the helpers later stages need.

    parse_conversation("openai" | "anthropic", messages, system=..., tools=...) -> Conversation
    to_wire(conversation)          the messages back in the provider's shape, unchanged
    wire_system / wire_tools       the same for Anthropic's ``system`` and for ``tools``
    tool_call_ids / tool_result_ids, text_of, message_text

Every refusal is an ``InvalidRequest`` whose message starts with the path it is about and whose
``field`` is that path (``messages.2.content.1.type``), so a proxy can point at its own input.
Shapes: ``openai_form.py`` and ``anthropic_form.py`` beside this module; limits: ``base.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationError

from ...shared.wire.errors import InvalidRequest
from . import anthropic_form as anth
from . import openai_form as oai
from .base import MAX_MESSAGES, PathError, clean_path

Format = Literal["openai", "anthropic"]
ChatMessage = oai.AnyOpenAIMessage | anth.AnyAnthropicMessage
ChatPart = oai.OpenAIPart | anth.AnthropicBlock
ChatTool = oai.OpenAITool | anth.AnthropicTool
_Count = Field(min_length=1, max_length=MAX_MESSAGES)
_OPENAI = TypeAdapter(Annotated[list[oai.OpenAIMessage], _Count])
_ANTHROPIC = TypeAdapter(Annotated[list[anth.AnthropicMessage], _Count])
_OPENAI_TOOLS = TypeAdapter(oai.OpenAITools)
_ANTHROPIC_TOOLS = TypeAdapter(anth.AnthropicTools)
_SYSTEM = TypeAdapter(anth.AnthropicSystem)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A validated conversation. ``system`` is Anthropic's top-level system prompt (OpenAI keeps
    system prompts as messages, so it is None there); ``tools`` is None when none were sent, so
    absent and empty stay distinguishable on the way back out."""

    format: Format
    messages: tuple[ChatMessage, ...]
    system: str | tuple[anth.TextBlock, ...] | None = None
    tools: tuple[ChatTool, ...] | None = None


def parse_conversation(format: Format, messages: list[Any], *, system: Any = None,
                       tools: list[Any] | None = None) -> Conversation:
    """Validate a conversation exactly as the proxy would send it to ``format``'s API.

    Refused (``InvalidRequest`` naming the path): unknown roles, part/block types and fields;
    a part the role may not hold (an image in a system message, tool_use from a user); ids or
    names outside the provider's pattern; limits of ``chat_base``; and tool traffic that does
    not pair up. A conversation ending with unanswered tool calls is refused as well: it is
    about to be sent, and both providers reject calls without results.
    """
    if format not in get_args(Format):
        raise InvalidRequest(f"format: unknown conversation format {format!r} (expected openai, anthropic)",
                             field="format")
    if format == "openai":
        return _parse_openai(messages, system, tools)
    return _parse_anthropic(messages, system, tools)


def _parse_openai(messages: list[Any], system: Any, tools: list[Any] | None) -> Conversation:
    if system is not None:
        raise InvalidRequest("system: OpenAI conversations carry system prompts as system or developer messages",
                             field="system")
    typed: list[oai.AnyOpenAIMessage] = _validate(_OPENAI, messages, "messages", "openai")
    oai.check_openai_pairing(typed)
    tool_list = None if tools is None else tuple(_validate(_OPENAI_TOOLS, tools, "tools", "openai"))
    return Conversation("openai", tuple(typed), None, tool_list)


def _parse_anthropic(messages: list[Any], system: Any, tools: list[Any] | None) -> Conversation:
    typed: list[anth.AnyAnthropicMessage] = _validate(_ANTHROPIC, messages, "messages", "anthropic")
    anth.check_anthropic_rules(typed)
    sys_value = None if system is None else _validate(_SYSTEM, system, "system", "anthropic")
    sys_typed = tuple(sys_value) if isinstance(sys_value, list) else sys_value
    tool_list = None if tools is None else tuple(_validate(_ANTHROPIC_TOOLS, tools, "tools", "anthropic"))
    return Conversation("anthropic", tuple(typed), sys_typed, tool_list)


def _validate(adapter: TypeAdapter[Any], value: Any, root: str, format: Format) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        path, why = _describe(exc.errors(include_url=False)[0], root, value, format)
        raise InvalidRequest(f"{path}: {why}"[:1000], field=path) from None


def _describe(err: Any, root: str, raw: Any, format: Format) -> tuple[str, str]:
    """(path, one-line reason) for pydantic's first error, in the words of this module."""
    loc = (root, *err["loc"])
    path = clean_path(loc)
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        field = "role" if ctx.get("discriminator") == "_role()" else "type"
        if kind == "union_tag_not_found":
            return f"{path}.{field}", f"missing {field} (each item must be a map with a string {field!r})"
        tag = str(ctx["tag"])[1:]
        expected = [t.strip().strip("'")[1:] for t in str(ctx["expected_tags"]).split(",")]
        return f"{path}.{field}", _tag_reason(field, tag, expected, path, raw, format)
    if kind == "value_error" and isinstance(ctx.get("error"), PathError):
        error: PathError = ctx["error"]
        return (f"{path}.{error.where}" if error.where else path), error.why
    if kind == "value_error":
        return path, str(ctx.get("error", err["msg"]))
    return path, str(err["msg"])


def _tag_reason(field: str, tag: str, expected: list[str], path: str, raw: Any, format: Format) -> str:
    allowed = ", ".join(expected)
    if field == "role":
        hint = " (Anthropic takes the system prompt in 'system')" if format == "anthropic" and tag == "system" else ""
        return f"unknown role {tag!r} (expected {allowed}){hint}"
    noun = "content part" if format == "openai" else "content block"
    parts = path.split(".")
    if len(parts) == 4 and parts[0] == "messages" and parts[2] == "content":
        role = raw[int(parts[1])].get("role")
        known = oai.PART_TYPES if format == "openai" else anth.BLOCK_TYPES
        if any(tag in types for types in known.values()):
            article = "an" if role == "assistant" else "a"
            return f"{article} {role} message cannot hold a {tag!r} {noun} (allowed: {allowed})"
    elif parts[-1] == "source":
        noun = "source"
    elif len(parts) >= 2 and parts[-2] == "citations":
        noun = "citation"
    return f"unknown {noun} type {tag!r} (expected {allowed})"


def to_wire(conversation: Conversation) -> list[dict[str, Any]]:
    """The messages in the provider's own shape, as the caller sent them: only fields the caller
    set are written (``exclude_unset``), so images, tool calls and signed thinking blocks pass
    through untouched and no default appears that was not in the input."""
    return [m.model_dump(exclude_unset=True) for m in conversation.messages]


def wire_system(conversation: Conversation) -> str | list[dict[str, Any]] | None:
    """Anthropic's top-level ``system`` as sent (None when absent or for OpenAI)."""
    system = conversation.system
    if system is None or isinstance(system, str):
        return system
    return [block.model_dump(exclude_unset=True) for block in system]


def wire_tools(conversation: Conversation) -> list[dict[str, Any]] | None:
    """The tool definitions as sent (None when the request had no ``tools``)."""
    if conversation.tools is None:
        return None
    return [tool.model_dump(exclude_unset=True) for tool in conversation.tools]


def tool_call_ids(message: ChatMessage) -> tuple[str, ...]:
    """Ids of the tool calls a message makes: OpenAI ``tool_calls``, Anthropic tool_use blocks."""
    if isinstance(message, anth.AnthropicUserMessage | anth.AnthropicAssistantMessage):
        return anth.anthropic_call_ids(message)
    return oai.openai_call_ids(message)


def tool_result_ids(message: ChatMessage) -> tuple[str, ...]:
    """Ids of the calls a message answers: an OpenAI tool message's ``tool_call_id``, Anthropic
    tool_result blocks' ``tool_use_id``."""
    if isinstance(message, anth.AnthropicUserMessage | anth.AnthropicAssistantMessage):
        return anth.anthropic_result_ids(message)
    return oai.openai_result_ids(message)


def text_of(part: ChatPart | str) -> str:
    """The text a part puts in front of the model: text, refusal, thinking, a tool result's
    text blocks, a plain-text document. Images, audio, files, PDFs, tool calls and redacted
    thinking have no text here (their token cost is counted by their own formulas)."""
    if isinstance(part, str):
        return part
    if isinstance(part, oai.TextPart | anth.TextBlock):
        return part.text
    if isinstance(part, oai.RefusalPart):
        return part.refusal
    if isinstance(part, anth.ThinkingBlock):
        return part.thinking
    if isinstance(part, anth.DocumentBlock) and isinstance(part.source, anth.PlainText):
        return part.source.data
    if isinstance(part, anth.ToolResultBlock):
        content = part.content
        if content is None or isinstance(content, str):
            return content or ""
        return "\n".join(text_of(block) for block in content)
    return ""


def message_text(message: ChatMessage) -> str:
    """All text of a message's content, parts joined by newlines (tool-call arguments and
    inputs are not included: they are counted as tool calls)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(text_of(part) for part in content)
