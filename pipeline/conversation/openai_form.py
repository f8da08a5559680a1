"""OpenAI Chat Completions conversations as strict, frozen pydantic models.

Shapes follow the request body of https://platform.openai.com/docs/api-reference/chat/create
(and the generated types of the official ``openai`` Python SDK, ``types/chat/*_param.py``):
roles system, developer, user, assistant and tool; content as a string or a list of parts.
Which part a role may hold is part of the model: text everywhere, ``image_url``,
``input_audio`` and ``file`` only from a user, ``refusal`` only from the assistant. The
deprecated ``function`` role and ``function_call`` field are refused, not converted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from ...shared.wire.errors import InvalidRequest
from .base import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    CallId,
    ChatModel,
    Data,
    JsonObject,
    Parts,
    PathError,
    Short,
    Text,
    ToolName,
    shape_of,
    tag_of,
)

# Every part type this module knows, per role (the errors name them).
PART_TYPES: dict[str, tuple[str, ...]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}
ROLES = tuple(PART_TYPES)


def _type(value: Any) -> str | None:
    return tag_of("type", value)


def _role(value: Any) -> str | None:
    return tag_of("role", value)


def _shape(value: Any) -> str | None:
    return shape_of(value)


class TextPart(ChatModel):
    type: Literal["text"]
    text: Text


class ImageURL(ChatModel):
    url: Data  # an https URL or a ``data:image/...;base64,`` URL
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(ChatModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(ChatModel):
    data: Data  # base64
    format: Literal["wav", "mp3"]


class AudioPart(ChatModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(ChatModel):
    file_id: Short | None = None
    file_data: Data | None = None
    filename: Short | None = None

    @model_validator(mode="after")
    def _one_source(self) -> FileRef:
        if self.file_id is None and self.file_data is None:
            raise PathError("", "a file part needs file_id or file_data")
        return self


class FilePart(ChatModel):
    type: Literal["file"]
    file: FileRef


class RefusalPart(ChatModel):
    type: Literal["refusal"]
    refusal: Text


UserPart = Annotated[
    Annotated[TextPart, Tag("~text")]
    | Annotated[ImagePart, Tag("~image_url")]
    | Annotated[AudioPart, Tag("~input_audio")]
    | Annotated[FilePart, Tag("~file")],
    Discriminator(_type),
]
AssistantPart = Annotated[
    Annotated[TextPart, Tag("~text")] | Annotated[RefusalPart, Tag("~refusal")], Discriminator(_type)
]
TextOnlyPart = Annotated[Annotated[TextPart, Tag("~text")], Discriminator(_type)]
_SHAPE = Discriminator(_shape, custom_error_type="content_shape",
                       custom_error_message="content must be a string or a list of content parts")
TextContent = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[Annotated[list[TextOnlyPart], Parts], Tag("~list")], _SHAPE
]
UserContent = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[Annotated[list[UserPart], Parts], Tag("~list")], _SHAPE
]
AssistantContent = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[Annotated[list[AssistantPart], Parts], Tag("~list")], _SHAPE
]
# ``name``: "An optional name for the participant"; the API enforces ^[a-zA-Z0-9_-]{1,64}$.
ParticipantName = ToolName


class SystemMessage(ChatModel):
    role: Literal["system"]
    content: TextContent
    name: ParticipantName | None = None


class DeveloperMessage(ChatModel):
    role: Literal["developer"]
    content: TextContent
    name: ParticipantName | None = None


class UserMessage(ChatModel):
    role: Literal["user"]
    content: UserContent
    name: ParticipantName | None = None


class FunctionCall(ChatModel):
    name: ToolName
    arguments: Text  # JSON text as the model produced it; not parsed (it may be invalid JSON)


class ToolCall(ChatModel):
    id: CallId
    type: Literal["function"]
    function: FunctionCall


class AudioRef(ChatModel):
    id: Short


class AssistantMessage(ChatModel):
    """``content`` may be null or absent when the message carries ``tool_calls`` (API docs:
    "Required unless tool_calls or function_call is specified")."""

    role: Literal["assistant"]
    content: AssistantContent | None = None
    name: ParticipantName | None = None
    refusal: Text | None = None
    audio: AudioRef | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls and self.refusal is None and self.audio is None:
            raise PathError("content", "an assistant message needs content unless it has tool_calls")
        return self


class ToolMessage(ChatModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: CallId


OpenAIMessage = Annotated[
    Annotated[SystemMessage, Tag("~system")]
    | Annotated[DeveloperMessage, Tag("~developer")]
    | Annotated[UserMessage, Tag("~user")]
    | Annotated[AssistantMessage, Tag("~assistant")]
    | Annotated[ToolMessage, Tag("~tool")],
    Discriminator(_role),
]
AnyOpenAIMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
OpenAIPart = TextPart | ImagePart | AudioPart | FilePart | RefusalPart


class FunctionDef(ChatModel):
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON Schema object; absent means no parameters
    strict: bool | None = None


class OpenAITool(ChatModel):
    type: Literal["function"]
    function: FunctionDef


OpenAITools = Annotated[list[OpenAITool], Field(max_length=MAX_TOOLS)]


def openai_call_ids(message: AnyOpenAIMessage) -> tuple[str, ...]:
    """Ids of the tool calls an assistant message makes (empty for any other message)."""
    if isinstance(message, AssistantMessage) and message.tool_calls:
        return tuple(call.id for call in message.tool_calls)
    return ()


def openai_result_ids(message: AnyOpenAIMessage) -> tuple[str, ...]:
    """The call a tool message answers, as a one-element tuple (empty for other roles)."""
    return (message.tool_call_id,) if isinstance(message, ToolMessage) else ()


def check_openai_pairing(messages: list[AnyOpenAIMessage]) -> None:
    """Refuse tool traffic the API refuses: a ``tool`` message must answer a call of the
    assistant message it follows (only tool messages in between) that is not answered yet; every
    call must be answered before the next non-tool message; call ids are unique. A conversation
    that ends with unanswered calls is refused too: the proxy is about to send it, and the API
    rejects "tool_calls must be followed by tool messages responding to each tool_call_id"."""
    open_calls: dict[str, str] = {}  # call id -> path of the call
    seen: set[str] = set()
    for i, message in enumerate(messages):
        if isinstance(message, ToolMessage):
            if message.tool_call_id not in open_calls:
                why = "answers a call that was already answered" if message.tool_call_id in seen else (
                    "answers no tool call of the assistant message before it")
                raise _refuse(f"messages.{i}.tool_call_id", f"{why} ({message.tool_call_id!r})")
            del open_calls[message.tool_call_id]
            continue
        _refuse_open(open_calls, f"before messages.{i} (a {message.role} message)")
        for k, call_id in enumerate(openai_call_ids(message)):
            if call_id in seen:
                raise _refuse(f"messages.{i}.tool_calls.{k}.id", f"duplicate tool call id {call_id!r}")
            seen.add(call_id)
            open_calls[call_id] = f"messages.{i}.tool_calls.{k}.id"
    _refuse_open(open_calls, "before the conversation ends")


def _refuse_open(open_calls: dict[str, str], where: str) -> None:
    for call_id, path in open_calls.items():
        raise _refuse(path, f"tool call {call_id!r} has no tool message answering it {where}")


def _refuse(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{path}: {why}", field=path)
