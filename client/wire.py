"""What the client library sends for a request, and what it makes of the reply (docs/assembly.md "Size limits").

A chat request travels with every base64 image replaced by its stub (``pipeline.counting.images``: its size
from the header and a digest, read here, once per call); the pictures stay in this process. The
reply carries a layout, not the conversation, and ``Outgoing.restore`` rebuilds the provider-ready
messages from the caller's own, so the kept parts come back as the very objects the caller passed.
A degraded response is built from the same stubbed request and restored the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ..pipeline.conversation.layout import restore
from ..pipeline.counting.images import stub_messages
from ..shared.config.settings import ClientSettings
from ..shared.wire.errors import InvalidRequest
from ..shared.wire.models import AssembleRequest, AssembleResponse

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
    messages = stub_messages(request.messages)
    if messages is request.messages:
        return Outgoing(request, request)
    return Outgoing(request, request.model_copy(update={"messages": messages}))


def text_chars(*docs: Any) -> int:
    """Characters in the strings of JSON-like documents (a conversation's size, for its
    timeout: ``AsyncClient.call_timeout``, ``HookConfig.call_timeout_s``); a walk over the nodes, no serialisation."""
    total, stack = 0, list(docs)
    while stack:
        doc = stack.pop()
        if isinstance(doc, str):
            total += len(doc)
        elif isinstance(doc, dict):
            stack.extend(doc.values())
        elif isinstance(doc, list | tuple):
            stack.extend(doc)
    return total


def scaled_timeout(request: AssembleRequest, default_s: float, settings: ClientSettings) -> float:
    """The timeout (seconds) of a call that gives none: ``default_s`` plus
    ``IBEX_CLIENT_TIMEOUT_MS_PER_MB`` for each million characters of its conversation (messages,
    system, tools, recent_messages, tool_schemas), at most ``IBEX_CLIENT_TIMEOUT_MAX_MS`` (never
    under ``default_s``). Validating, sending, decoding and counting a 1 MB conversation takes far
    longer than a timeout that suits a short one; a fast assembly still answers when it is done."""
    chars = text_chars(request.messages, request.system, request.tools, request.recent_messages,
                       request.tool_schemas)
    scaled = default_s + settings.client_timeout_ms_per_mb * chars / 1e9
    return min(scaled, max(default_s, settings.client_timeout_max_ms / 1000))


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
