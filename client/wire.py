"""What the client library sends for a request, and what it makes of the reply (README "Size limits").

A chat request travels with every base64 image replaced by its stub (``shared.images``: its size
from the header and a digest, read here, once per call); the pictures stay in this process. The
reply carries a layout, not the conversation, and ``Outgoing.restore`` rebuilds the provider-ready
messages from the caller's own, so the kept parts come back as the very objects the caller passed.
A degraded response is built from the same stubbed request and restored the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ibex_context.shared.chat_layout import restore
from ibex_context.shared.errors import InvalidRequest
from ibex_context.shared.images import data_url_payload, stub_for, stubbable
from ibex_context.shared.models import AssembleRequest, AssembleResponse

# The fields a caller's conversation travels in, per request form: what a size error names.
CHAT_FIELDS = ("messages", "tools", "system", "query")
FLAT_FIELDS = ("recent_messages", "tool_schemas", "query")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One call's request as the caller made it, and as it travels (its images as stubs)."""

    request: AssembleRequest
    sent: AssembleRequest

    def restore(self, response: AssembleResponse) -> AssembleResponse:
        """The reply with the provider-ready conversation rebuilt from the caller's own."""
        return restore(response, self.request.messages, self.request.system)


def outgoing(request: AssembleRequest) -> Outgoing:
    """The request to send: a chat conversation's base64 images as stubs, nothing else changed
    (a message without one is the caller's own object)."""
    if request.format is None or not request.messages:
        return Outgoing(request, request)
    messages = [_slim_message(m) for m in request.messages]
    if all(a is b for a, b in zip(messages, request.messages, strict=True)):
        return Outgoing(request, request)
    return Outgoing(request, request.model_copy(update={"messages": messages}))


def _slim_message(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    slim = _slim_blocks(content)
    return message if slim is content else {**message, "content": slim}


def _slim_blocks(blocks: list[Any]) -> list[Any]:
    """``blocks`` with each image as a stub; the same list when nothing changed."""
    slim = [_slim_block(b) for b in blocks]
    return blocks if all(a is b for a, b in zip(slim, blocks, strict=True)) else slim


def _slim_block(block: Any) -> Any:
    """An OpenAI ``image_url`` part or Anthropic ``image`` block with its base64 payload as a stub
    (inside ``tool_result`` content too); any other block, or a shape the service will refuse, as is."""
    if not isinstance(block, dict):
        return block
    kind = block.get("type")
    if kind == "image_url" and isinstance(image := block.get("image_url"), dict):
        payload = data_url_payload(image.get("url"))
        if stubbable(payload):
            return {**block, "image_url": {**image, "url": stub_for(payload)}}  # type: ignore[arg-type]
    elif kind == "image" and isinstance(source := block.get("source"), dict):
        if source.get("type") == "base64" and stubbable(source.get("data")):
            return {**block, "source": {**source, "data": stub_for(source["data"])}}
    elif kind == "tool_result" and isinstance(content := block.get("content"), list):
        slim = _slim_blocks(content)
        return block if slim is content else {**block, "content": slim}
    return block


def too_large(request: AssembleRequest, size: int, limit: int) -> InvalidRequest:
    """The refusal of a payload over ``limit``, naming the field the caller sent that takes most of
    it (``messages`` or ``tools`` for a chat request, ``recent_messages`` or ``tool_schemas``)."""
    fields = CHAT_FIELDS if request.format is not None else FLAT_FIELDS
    doc = request.model_dump(mode="python", include=set(fields))
    sizes = {f: len(msgpack.packb(doc[f], use_bin_type=True)) for f in fields}
    biggest = max(sizes, key=lambda f: sizes[f])
    hint = "fewer" if biggest in ("tools", "tool_schemas") else "less"
    return InvalidRequest(
        f"request payload is {size} bytes, over the limit of {limit} bytes (IBEX_MAX_REQUEST_BYTES); "
        f"{biggest} takes {sizes[biggest]} of them: send {hint} in {biggest}", field=biggest,
        request_id=request.request_id)
