"""Which LiteLLM calls the hook assembles, and in which request form (no LiteLLM import here).

One form inside: each route's request is read into the service's chat-native form (``openai`` or
``anthropic`` messages, system and tools), assembled once, and the assembly written back in the
route's own shape (docs/litellm.md):

* ``/v1/chat/completions`` (``completion``, ``acompletion``): OpenAI messages and tools, as is;
* ``/v1/messages`` (``anthropic_messages``): Anthropic ``system``, messages and tools, as is;
* ``/v1/responses`` (``responses``, ``aresponses``): ``instructions`` and ``input`` items converted
  to OpenAI chat messages and back (``litellm.responses``).

Any other call type, or a request these forms cannot carry, is not assembled: ``request_form``
answers why, and the hook passes the call on as sent, saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ....shared.wire.models import AssembleResponse
from ...wire import text_chars
from . import responses as litellm_responses

CHAT_CALLS = frozenset({"completion", "acompletion"})
ANTHROPIC_CALLS = frozenset({"anthropic_messages", "aanthropic_messages"})
RESPONSES_CALLS = frozenset({"responses", "aresponses"})


class NotAssembled(Exception):
    """The assembly has no messages to write back (never for a chat-native request)."""


@dataclass(frozen=True, slots=True)
class Form:
    """A call's conversation in the service's chat-native form, and how to write the assembly back."""

    format: Literal["openai", "anthropic"]
    messages: list[Any]
    write: Callable[[dict[str, Any], AssembleResponse], None]
    system: Any = None
    tools: list[Any] = field(default_factory=list)
    route: Literal["chat_completions", "messages", "responses"] = "chat_completions"

    @property
    def chars(self) -> int:
        """The conversation's size in characters (messages, system, tools)."""
        return text_chars(self.messages, self.system, self.tools)


def _messages(assembly: AssembleResponse) -> list[dict[str, Any]]:
    if assembly.messages is None:
        raise NotAssembled("the assembly has no messages")
    return assembly.messages


def _write_chat(data: dict[str, Any], assembly: AssembleResponse) -> None:
    data["messages"] = _messages(assembly)


def _write_anthropic(data: dict[str, Any], assembly: AssembleResponse) -> None:
    data["messages"] = _messages(assembly)
    if assembly.system:
        data["system"] = assembly.system
    else:
        data.pop("system", None)


def _tools(data: dict[str, Any]) -> list[Any] | None:
    tools = data.get("tools")
    return [] if tools is None else tools if isinstance(tools, list) else None


def request_form(call_type: str, data: dict[str, Any]) -> Form | str:
    """The call's conversation in chat-native form, or why it is not assembled (one line)."""
    messages, tools = data.get("messages"), _tools(data)
    if call_type in CHAT_CALLS or call_type in ANTHROPIC_CALLS:
        if not isinstance(messages, list) or tools is None:
            return f"{call_type} call without a messages list (or with tools that are not a list)"
        if call_type in CHAT_CALLS:
            return Form("openai", messages, _write_chat, tools=tools)
        return Form("anthropic", messages, _write_anthropic, system=data.get("system"), tools=tools, route="messages")
    if call_type in RESPONSES_CALLS:
        chat = litellm_responses.to_chat(data)
        if isinstance(chat, str):
            return chat
        return Form("openai", chat.messages, chat.write, tools=chat.tools, route="responses")
    return f"{call_type} calls are not assembled"
