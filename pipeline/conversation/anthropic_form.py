"""Anthropic Messages conversations as strict, frozen pydantic models.

Shapes follow https://docs.anthropic.com/en/api/messages and the generated request types of
the official ``anthropic`` Python SDK (``types/*_block_param.py``): a top-level ``system``
(string or text blocks), user/assistant messages whose content is a string or content blocks.
A user may send text, image, document and tool_result blocks; the assistant text, tool_use,
thinking and redacted_thinking blocks. ``cache_control`` is accepted where the SDK types
accept it (text, image, document, tool_use, tool_result, tools), not on thinking blocks.
Other block types (search_result, server tool blocks, document ``content`` sources, web-search
citations) are refused by name rather than passed through unchecked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag

from ...shared.wire.errors import InvalidRequest
from .base import (
    MAX_PARTS,
    MAX_TOOLS,
    ChatModel,
    Data,
    JsonObject,
    Parts,
    Short,
    Text,
    ToolName,
    shape_of,
    tag_of,
)

BLOCK_TYPES: dict[str, tuple[str, ...]] = {
    "user": ("text", "image", "document", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
ROLES = tuple(BLOCK_TYPES)
# tool_use ids as the API validates them: ^[a-zA-Z0-9_-]+$ (bounded by us to 256 characters).
ToolUseId = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,256}$")]
NonNeg = Annotated[int, Field(ge=0)]


def _type(value: Any) -> str | None:
    return tag_of("type", value)


def _role(value: Any) -> str | None:
    return tag_of("role", value)


def _shape(value: Any) -> str | None:
    return shape_of(value)


class CacheControl(ChatModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None  # https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching


class _Cited(ChatModel):
    cited_text: Text
    document_index: NonNeg
    document_title: Short | None


class CharLocation(_Cited):
    type: Literal["char_location"]
    start_char_index: NonNeg
    end_char_index: NonNeg


class PageLocation(_Cited):
    type: Literal["page_location"]
    start_page_number: NonNeg
    end_page_number: NonNeg


class BlockLocation(_Cited):
    type: Literal["content_block_location"]
    start_block_index: NonNeg
    end_block_index: NonNeg


Citation = Annotated[
    Annotated[CharLocation, Tag("~char_location")]
    | Annotated[PageLocation, Tag("~page_location")]
    | Annotated[BlockLocation, Tag("~content_block_location")],
    Discriminator(_type),
]


class TextBlock(ChatModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: Annotated[list[Citation], Field(max_length=MAX_PARTS)] | None = None


class Base64Image(ChatModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: Data


class URLSource(ChatModel):
    type: Literal["url"]
    url: Data


class ImageBlock(ChatModel):
    type: Literal["image"]
    source: Annotated[Annotated[Base64Image, Tag("~base64")] | Annotated[URLSource, Tag("~url")], Discriminator(_type)]
    cache_control: CacheControl | None = None


class Base64PDF(ChatModel):
    type: Literal["base64"]
    media_type: Literal["application/pdf"]
    data: Data


class PlainText(ChatModel):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: Text


class CitationsConfig(ChatModel):
    enabled: bool


class DocumentBlock(ChatModel):
    type: Literal["document"]
    source: Annotated[
        Annotated[Base64PDF, Tag("~base64")] | Annotated[PlainText, Tag("~text")] | Annotated[URLSource, Tag("~url")],
        Discriminator(_type),
    ]
    title: Short | None = None
    context: Text | None = None
    citations: CitationsConfig | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(ChatModel):
    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: JsonObject
    cache_control: CacheControl | None = None


ResultPart = Annotated[Annotated[TextBlock, Tag("~text")] | Annotated[ImageBlock, Tag("~image")], Discriminator(_type)]
_ResultParts = Annotated[list[ResultPart], Field(max_length=MAX_PARTS)]
_SHAPE = Discriminator(_shape, custom_error_type="content_shape",
                       custom_error_message="content must be a string or a list of content blocks")


class ToolResultBlock(ChatModel):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: Annotated[Annotated[Text, Tag("~str")] | Annotated[_ResultParts, Tag("~list")], _SHAPE] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(ChatModel):
    """Passed back unmodified: the API checks ``signature`` against the thinking text."""

    type: Literal["thinking"]
    thinking: Text
    signature: Data


class RedactedThinkingBlock(ChatModel):
    type: Literal["redacted_thinking"]
    data: Data


UserBlock = Annotated[
    Annotated[TextBlock, Tag("~text")]
    | Annotated[ImageBlock, Tag("~image")]
    | Annotated[DocumentBlock, Tag("~document")]
    | Annotated[ToolResultBlock, Tag("~tool_result")],
    Discriminator(_type),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("~text")]
    | Annotated[ToolUseBlock, Tag("~tool_use")]
    | Annotated[ThinkingBlock, Tag("~thinking")]
    | Annotated[RedactedThinkingBlock, Tag("~redacted_thinking")],
    Discriminator(_type),
]
# Lists may be empty at the model level; ``check_anthropic_rules`` applies the API's own rule
# (only a final assistant message may be empty) so that error can say so.
_Blocks = Field(max_length=MAX_PARTS)


class AnthropicUserMessage(ChatModel):
    role: Literal["user"]
    content: Annotated[
        Annotated[Text, Tag("~str")] | Annotated[Annotated[list[UserBlock], _Blocks], Tag("~list")], _SHAPE
    ]


class AnthropicAssistantMessage(ChatModel):
    role: Literal["assistant"]
    content: Annotated[
        Annotated[Text, Tag("~str")] | Annotated[Annotated[list[AssistantBlock], _Blocks], Tag("~list")], _SHAPE
    ]


AnthropicMessage = Annotated[
    Annotated[AnthropicUserMessage, Tag("~user")] | Annotated[AnthropicAssistantMessage, Tag("~assistant")],
    Discriminator(_role),
]
AnyAnthropicMessage = AnthropicUserMessage | AnthropicAssistantMessage
AnthropicBlock = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock)
SystemBlock = Annotated[Annotated[TextBlock, Tag("~text")], Discriminator(_type)]
AnthropicSystem = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[Annotated[list[SystemBlock], Parts], Tag("~list")], _SHAPE
]


class AnthropicTool(ChatModel):
    name: ToolName
    description: Text | None = None
    input_schema: JsonObject
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None


AnthropicTools = Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)]


def anthropic_call_ids(message: AnyAnthropicMessage) -> tuple[str, ...]:
    """Ids of the tool_use blocks of an assistant message (empty otherwise)."""
    if isinstance(message, AnthropicAssistantMessage) and isinstance(message.content, list):
        return tuple(b.id for b in message.content if isinstance(b, ToolUseBlock))
    return ()


def anthropic_result_ids(message: AnyAnthropicMessage) -> tuple[str, ...]:
    """The tool_use ids a user message's tool_result blocks answer, in order."""
    if isinstance(message, AnthropicUserMessage) and isinstance(message.content, list):
        return tuple(b.tool_use_id for b in message.content if isinstance(b, ToolResultBlock))
    return ()


def check_anthropic_rules(messages: list[AnyAnthropicMessage]) -> None:
    """The conversation rules the Messages API enforces beyond each block's shape.

    - The first message is a user message (the API refuses an assistant first turn).
      Consecutive same-role messages are allowed: the API "combines" them into one turn.
    - Only a final assistant message (a prefill) may have empty content.
    - A tool_result answers a tool_use of the immediately preceding message, which must be an
      assistant message; each tool_use is answered in the very next message, whose content
      begins with its tool_result blocks (the API: "Messages following tool_use blocks must
      begin with a matching number of tool_result blocks"), so a conversation cannot end with
      an unanswered tool_use. tool_use ids are unique and answered once.
    """
    if messages[0].role != "user":
        raise _refuse("messages.0.role", "the first message must be a user message")
    seen: set[str] = set()
    for i, message in enumerate(messages):
        if not message.content and not (i == len(messages) - 1 and message.role == "assistant"):
            raise _refuse(f"messages.{i}.content", "must not be empty (only a final assistant message may be)")
        calls = anthropic_call_ids(message)
        for k, call_id in _call_positions(message):
            if call_id in seen:
                raise _refuse(f"messages.{i}.content.{k}.id", f"duplicate tool_use id {call_id!r}")
            seen.add(call_id)
        if calls:
            _check_answered(messages, i)
        if isinstance(message, AnthropicUserMessage):
            _check_results(messages, i)


def _call_positions(message: AnyAnthropicMessage) -> list[tuple[int, str]]:
    if not isinstance(message.content, list):
        return []
    return [(k, b.id) for k, b in enumerate(message.content) if isinstance(b, ToolUseBlock)]


def _check_answered(messages: list[AnyAnthropicMessage], i: int) -> None:
    """Every tool_use of assistant message ``i`` is answered by message ``i + 1``."""
    answers = set(anthropic_result_ids(messages[i + 1])) if i + 1 < len(messages) else set()
    for k, call_id in _call_positions(messages[i]):
        if call_id not in answers:
            where = f"in messages.{i + 1}" if i + 1 < len(messages) else "before the conversation ends"
            raise _refuse(f"messages.{i}.content.{k}.id",
                          f"tool_use {call_id!r} has no tool_result answering it {where}")


def _check_results(messages: list[AnyAnthropicMessage], i: int) -> None:
    """Each tool_result of user message ``i`` answers a distinct tool_use of message ``i - 1``
    and comes before every other block of the message."""
    content = messages[i].content
    if not isinstance(content, list):
        return
    open_calls = set(anthropic_call_ids(messages[i - 1])) if i > 0 else set()
    answered: set[str] = set()
    leading = True
    for k, block in enumerate(content):
        if not isinstance(block, ToolResultBlock):
            leading = False
            continue
        path = f"messages.{i}.content.{k}"
        if not leading:
            raise _refuse(f"{path}.type", "tool_result blocks must come before every other block of the message")
        if block.tool_use_id in answered:
            raise _refuse(f"{path}.tool_use_id", f"tool_use {block.tool_use_id!r} is answered twice")
        if block.tool_use_id not in open_calls:
            raise _refuse(f"{path}.tool_use_id",
                          f"no tool_use {block.tool_use_id!r} in the assistant message just before it")
        answered.add(block.tool_use_id)


def _refuse(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{path}: {why}", field=path)
