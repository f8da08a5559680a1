"""Per-request CPU bounds (``worker.cost``, ``pipeline.counting.images``) through the real stack: a request's
maps and arrays are counted while it is unpacked and one over ``IBEX_MAX_REQUEST_ITEMS`` is refused
INVALID_REQUEST naming the field and the limit, before anything else is done with it; a base64 image
a raw-protocol caller sends is read once, on receipt, whatever its bytes hold.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.counting.image_tokens import openai_image_tokens
from ibex_context.shared.config.settings import WorkerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.errors import InvalidRequest
from ibex_context.shared.wire.protocol import Envelope, pack_header
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(240)

LIMIT = WorkerSettings().max_request_items
ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
       "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
ITEMS_PER_PAIR = 5  # the call message, its tool_calls list, the call, its function; the tool message


def tool_pairs(n: int) -> list[dict[str, Any]]:
    """A conversation of ``n`` tool-call rounds (OpenAI shape) between two user turns."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Check every invoice."}]
    for i in range(n):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": "ok"}]
    return [*messages, {"role": "user", "content": "Which one is unpaid?"}]


def fill_jpeg(n: int) -> str:
    """A JPEG start followed by ``n`` fill bytes: no frame header anywhere (an unknown size)."""
    return base64.b64encode(b"\xff\xd8" + b"\xff" * n + b"\xff\xd9").decode()


def raw_frames(i: int, **fields: Any) -> list[bytes]:
    """A raw-protocol chat request (no client library: images travel as the caller sent them)."""
    doc = {"v": 1, "request_id": f"raw-{i}", "org_id": "acme", "agent_id": "support-bot", "model": "gpt-4o",
           "query": "invoice", "format": "openai", "deadline_ns": time.time_ns() + 20 * 10**9, **fields}
    header = pack_header(Envelope(doc["request_id"], doc["org_id"], doc["agent_id"], doc["deadline_ns"]))
    return P.request_frames(header, msgpack.packb(doc))


async def raw_exchange(stack: LocalStack, frames: list[bytes]) -> tuple[bytes, dict[str, Any]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.frontend)
    try:
        await sock.send_multipart(frames)
        reply = await asyncio.wait_for(sock.recv_multipart(), 30)
        return reply[1], msgpack.unpackb(reply[3])
    finally:
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("request-cost"), workers=1, env=ENV)
    try:
        yield s
    finally:
        s.stop()


async def test_a_request_over_the_item_limit_is_refused_naming_the_field_and_the_limit(stack: LocalStack) -> None:
    pairs = LIMIT // ITEMS_PER_PAIR - 10
    async with AsyncClient(stack.frontend) as c:
        served = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4.1", query="unpaid invoice",
                                  format="openai", messages=tool_pairs(pairs), timeout=20.0)
        assert not served.degraded and served.layout is not None  # just under the limit: served whole
        with pytest.raises(InvalidRequest) as refused:
            await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4.1", query="unpaid invoice",
                             format="openai", messages=tool_pairs(pairs + 20), timeout=20.0)
    assert refused.value.field == "messages"
    assert "IBEX_MAX_REQUEST_ITEMS" in refused.value.message and str(LIMIT) in refused.value.message


async def test_a_huge_payload_of_tiny_parts_is_refused_at_the_limit_not_after_decoding(stack: LocalStack) -> None:
    """13 MB of empty text parts (800 messages of 1,000): the codec's walk alone cost ~3 s of the
    worker's loop; counted while unpacked, it is refused within the item limit."""
    parts = [{"type": "text", "text": ""}] * 1000
    frames = raw_frames(1, messages=[{"role": "user", "content": parts} for _ in range(800)])
    t0 = time.monotonic()
    cmd, body = await raw_exchange(stack, frames)
    assert cmd == P.ERROR and body["code"] == "INVALID_REQUEST" and body["field"] == "messages", body
    assert "IBEX_MAX_REQUEST_ITEMS" in body["message"] and body["request_id"] == "raw-1"
    assert time.monotonic() - t0 < 2.5


async def test_a_raw_image_is_read_once_whatever_its_bytes_hold(stack: LocalStack) -> None:
    """A 3 MB JPEG of fill bytes as a data URL: a header walk that stepped through every fill byte would
    cost ~80 ms a megabyte, in the budget and again in formatting; it is one bounded read on
    receipt, and the image is charged as an unknown size."""
    image = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + fill_jpeg(3_000_000)}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Is this my invoice?"}, image]}]
    cmd, body = await raw_exchange(stack, raw_frames(2, messages=messages))
    assert cmd == P.REPLY, body
    text_only = await raw_exchange(stack, raw_frames(3, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Is this my invoice?"}]}]))
    charged = body["prompt_tokens"] - text_only[1]["prompt_tokens"]
    assert charged == openai_image_tokens(None, None, "auto", model="gpt-4o")  # unknown size: the maximum
    stages = sum(body["timings_us"].get(k, 0) for k in ("budget", "scoring", "packing", "formatting"))
    assert stages < 150_000, body["timings_us"]
