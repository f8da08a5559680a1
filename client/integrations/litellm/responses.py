"""``/v1/responses`` requests as OpenAI chat messages and back (no LiteLLM import here).

OpenAI's Responses API carries the conversation as ``instructions`` and ``input`` (a string, or
items: role messages, ``function_call`` and ``function_call_output``); the service assembles chat
messages. ``to_chat`` converts:

* ``instructions`` -> a leading system message; written back to ``instructions``;
* a string ``input`` -> one user message;
* a message item -> a chat message of that role (``input_text``/``output_text`` -> text parts,
  ``input_image`` with an ``image_url`` -> ``image_url`` parts);
* consecutive ``function_call`` items -> one assistant message with those ``tool_calls`` (with
  the assistant message just before them, when there is one); ``function_call_output`` -> a
  ``tool`` message;
* function tools -> chat function tools (counted, never rewritten).

Messages the assembly keeps unchanged go back as the caller's own items, verbatim (ids,
statuses, annotations); the ones it adds (directive, memories) as role messages. What these
forms cannot carry is not assembled, and the reason says what: a conversation the provider
keeps (``previous_response_id``, ``conversation``, a stored ``prompt``), other item types
(reasoning, file and web search calls, ``item_reference``...), ``input_file`` or a file-id image,
and tools other than functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....shared.wire.models import AssembleResponse

SERVER_STATE = ("previous_response_id", "conversation", "prompt")
ROLES = frozenset({"user", "assistant", "system", "developer"})


class Unconvertible(Exception):
    """A part of the request that chat messages cannot carry (the call is passed on as sent)."""


@dataclass(slots=True)
class Chat:
    """The request as chat messages, each with the items it came from (``None``: ``instructions``)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[list[Any] | None] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)

    def write(self, data: dict[str, Any], assembly: AssembleResponse) -> None:
        """The assembly back into ``instructions`` and ``input`` items."""
        if assembly.messages is None:
            raise Unconvertible("the assembly has no messages")
        items: list[Any] = []
        instructions: str | None = None
        at = 0  # the assembly keeps the caller's messages in order: match each one forward
        for msg in assembly.messages:
            found = next((i for i in range(at, len(self.messages)) if self.messages[i] == msg), None)
            if found is None:
                items.extend(from_message(msg))
                continue
            at = found + 1
            origin = self.origins[found]
            if origin is None:
                instructions = str(msg["content"])
            else:
                items.extend(origin)
        data["input"] = items
        if instructions is not None:
            data["instructions"] = instructions
        else:
            data.pop("instructions", None)


def _text_part(part: Mapping[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        image = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
        return {"type": "image_url", "image_url": image}
    raise Unconvertible(f"a {kind or 'untyped'} content part" + (" without an image_url" if kind == "input_image"
                                                                else ""))


def _message(item: Mapping[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise Unconvertible(f"a message with role {role!r}")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise Unconvertible("a message whose content is neither text nor a list of parts")
    return {"role": role, "content": [_text_part(p) if isinstance(p, Mapping) else _text_part({}) for p in content]}


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise Unconvertible("a function_call without call_id, name and arguments")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _output(item: Mapping[str, Any]) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        output = [_text_part(p) if isinstance(p, Mapping) else _text_part({}) for p in output]
        if any(p["type"] != "text" for p in output):
            raise Unconvertible("a function_call_output with an image")
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
        raise Unconvertible("a function_call_output without call_id and output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _add_item(chat: Chat, item: Any) -> None:
    if not isinstance(item, Mapping):
        raise Unconvertible("an input item that is not an object")
    kind = item.get("type", "message")
    last = chat.messages[-1] if chat.messages else None
    if kind == "function_call":
        call = _call(item)
        origin = chat.origins[-1] if chat.origins else None
        if last is not None and origin is not None and last["role"] == "assistant":  # that turn's call
            last.setdefault("tool_calls", []).append(call)
            origin.append(item)
        else:
            chat.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            chat.origins.append([item])
    elif kind == "function_call_output":
        chat.messages.append(_output(item))
        chat.origins.append([item])
    elif kind == "message":
        chat.messages.append(_message(item))
        chat.origins.append([item])
    else:
        raise Unconvertible(f"{kind} input items")


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise Unconvertible(f"{kind or 'untyped'} tools (only function tools are counted)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def to_chat(data: Mapping[str, Any]) -> Chat | str:
    """The request as chat messages, or why it is not assembled (one line)."""
    held = [k for k in SERVER_STATE if data.get(k)]
    if held:
        return f"responses call with {held[0]}: the provider keeps this conversation, not assembled"
    chat = Chat()
    try:
        instructions = data.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise Unconvertible("instructions that are not text")
            chat.messages.append({"role": "system", "content": instructions})
            chat.origins.append(None)
        raw = data.get("input")
        if not isinstance(raw, str | list):
            raise Unconvertible("an input that is neither text nor a list of items")
        for item in [{"role": "user", "content": raw}] if isinstance(raw, str) else raw:
            _add_item(chat, item)
        chat.tools = [_tool(t) for t in data.get("tools") or []]
    except Unconvertible as exc:
        return f"responses call with {exc}: not assembled"
    return chat


def from_message(msg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Input items for a chat message the assembly added (a text or parts message, or tool turns)."""
    role, content = msg.get("role"), msg.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": msg.get("tool_call_id"), "output": content}]
    items: list[dict[str, Any]] = []
    if isinstance(content, list):
        text = "output_text" if role == "assistant" else "input_text"
        parts = [{"type": text, "text": p.get("text")} if p.get("type") == "text" else
                 {"type": "input_image", "image_url": (p.get("image_url") or {}).get("url")} for p in content]
        items.append({"role": role, "content": parts})
    elif content is not None:
        items.append({"role": role, "content": content})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append({"type": "function_call", "call_id": call.get("id"), "name": fn.get("name"),
                      "arguments": fn.get("arguments")})
    return items
