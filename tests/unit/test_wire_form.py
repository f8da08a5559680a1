"""The chat wire form (client/wire.py, pipeline/counting/images.py, pipeline/conversation/layout.py), offline.

Images travel as stubs (size from the header, digest), replies as a layout over the caller's own
conversation. What the pipeline makes of the stubbed request is what it makes of the original
(same counts, same layout), and the client's rebuild is the original pipeline's messages, the
caller's parts as the very objects passed. The real stack: tests/stack/test_wire_stack.py.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ibex_context.client.wire import outgoing
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation.layout import for_wire, materialize, restore
from ibex_context.pipeline.counting.chat_count import image_size
from ibex_context.pipeline.counting.images import MIN_STUBBED, stub_for, stub_size
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.config.settings import WIRE_BYTES_PER_TOKEN, Settings
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.errors import Internal
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse, ChatLayout, Piece, Placed
from tests.properties import examples
from tests.unit.test_chat_count import gif, jpeg, png, webp

CATALOG = Catalog.load()
HITS = [MemoryHit(f"m{i}", f"memory {i}: the October invoice went to billing contact {i}", "fact",
                  0.95 - i / 100, 0.8, i + 1, "hot") for i in range(8)]
PAD = b"\0" * 3000  # past MIN_STUBBED once base64-encoded; headers are read from the front


def _b64(data: bytes) -> str:
    return base64.b64encode(data + PAD).decode()


def _openai_image(data: bytes, mime: str = "image/png", detail: str = "high") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{_b64(data)}", "detail": detail}}


def _anthropic_image(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": _b64(data)}}


def _req(messages: list[Any], *, fmt: str = "openai", model: str = "gpt-4.1", **kw: Any) -> AssembleRequest:
    return AssembleRequest(request_id="r", org_id="acme", agent_id="support-bot", model=model, query="invoice",
                           format=fmt, messages=messages, deadline_ns=1, **kw)  # type: ignore[arg-type]


def _run(req: AssembleRequest) -> AssembleResponse:
    return assemble(req, offline_result(directive="Answer billing questions briefly.", hot=HITS, cold=[]),
                    Engine(CATALOG, Policy()), nonce="0" * 16)


IMAGES = [(png(1000, 800), "image/png", (1000, 800)), (gif(64, 48), "image/gif", (64, 48)),
          (jpeg(640, 480, app_padding=60000), "image/jpeg", (640, 480)),
          (webp(300, 200, "VP8X"), "image/webp", (300, 200))]


@pytest.mark.parametrize(("data", "mime", "size"), IMAGES)
def test_a_stub_carries_the_header_size_and_a_digest(data: bytes, mime: str, size: tuple[int, int]) -> None:
    for part in (_openai_image(data, mime), _anthropic_image(data, mime)):
        sent = outgoing(_req([{"role": "user", "content": [part]}], fmt="openai")).sent.messages[0]["content"][0]
        assert image_size(sent) == image_size(part) == size
        assert len(json.dumps(sent)) < 200 < len(json.dumps(part))
    stubs = {stub_for(_b64(data)), stub_for(_b64(data + b"x"))}
    assert len(stubs) == 2 and {stub_size(s) for s in stubs} == {size}  # same size, two images


def test_what_a_header_does_not_give_is_charged_as_unknown() -> None:
    assert stub_size(stub_for(base64.b64encode(b"not an image" * 100).decode())) is None
    assert stub_for("A" * 400).startswith("ibex-image:0x0;sha256=")
    for bad in ("ibex-image:10x10", "ibex-image:10x10;sha256=zz", "ibex-image:-1x5;sha256=" + "0" * 64):
        assert stub_size(bad) is None and image_size({"type": "image_url", "image_url": {"url": bad}}) is None


def test_urls_small_images_and_other_parts_travel_as_they_are() -> None:
    tiny = {"type": "image_url", "image_url": {"url": "data:image/gif;base64," + base64.b64encode(gif(1, 1)).decode()}}
    assert len(tiny["image_url"]["url"]) < MIN_STUBBED
    url = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    odd = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "é" * 500}}  # the worker refuses it
    messages = [{"role": "user", "content": [tiny, url, odd, {"type": "text", "text": "x" * 5000}]},
                {"role": "assistant", "content": "y" * 5000}]
    out = outgoing(_req(messages))
    assert out.sent is out.request and out.sent.messages[0] is messages[0]


def _openai_conversation(image: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are Acme's support agent."},
            {"role": "user", "content": [{"type": "text", "text": "Is this my invoice?"}, image]},
            {"role": "assistant", "content": "It is invoice #42."},
            {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image]}]


def _anthropic_conversation(image: dict[str, Any]) -> list[dict[str, Any]]:
    call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "invoice"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "found"}, image]}
    return [{"role": "user", "content": [{"type": "text", "text": "Is this my invoice?"}, image]},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result, {"type": "text", "text": "compare them"}, image]}]


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
@pytest.mark.parametrize("breakpoints", [False, True])
def test_the_rebuilt_reply_is_the_original_pipelines_with_the_callers_objects(fmt: str, breakpoints: bool) -> None:
    image = _openai_image(png(1000, 800)) if fmt == "openai" else _anthropic_image(png(1000, 800))
    convo = _openai_conversation(image) if fmt == "openai" else _anthropic_conversation(image)
    system = None if fmt == "openai" else [{"type": "text", "text": "You are Acme's support agent."}]
    req = _req(convo, fmt=fmt, model="gpt-4.1" if fmt == "openai" else "claude-sonnet-4", system=system,
               options={"cache_breakpoints": breakpoints})
    original, out = _run(req), outgoing(req)
    assert out.sent is not req
    slim = _run(out.sent)
    assert (slim.prompt_tokens, slim.stable_prefix_tokens, slim.layout, slim.cache_breakpoints) == (
        original.prompt_tokens, original.stable_prefix_tokens, original.layout, original.cache_breakpoints)
    wire = for_wire(slim)
    body = encode(wire)
    assert wire.messages is None and b"ibex-image" not in body and len(body) < 12_000
    rebuilt = restore(AssembleResponse.model_validate(wire.model_dump()), req.messages, req.system)
    assert json.dumps([rebuilt.messages, rebuilt.system]) == json.dumps([original.messages, original.system])
    assert rebuilt.messages is not None and original.layout is not None
    kept = [i for i in original.layout.messages if isinstance(i, int)]
    assert kept and all(any(m is convo[i] for m in rebuilt.messages) for i in kept)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4000), st.booleans()), min_size=1, max_size=40), st.sampled_from(
    ["gpt-4", "gpt-4o", "gpt-4.1"]))
def test_property_trimmed_rebuilds_match_and_replies_stay_small(turns: list[tuple[int, bool]], model: str) -> None:
    image = _openai_image(png(1200, 900))
    convo: list[dict[str, Any]] = []
    for i, (words, with_image) in enumerate(turns):
        text = f"turn {i} " + "word " * words
        convo.append({"role": "user", "content": [{"type": "text", "text": text}, image] if with_image else text})
        convo.append({"role": "assistant", "content": f"answer {i}"})
    convo.append({"role": "user", "content": "and now?"})
    req = _req(convo, model=model)
    original, slim = _run(req), _run(outgoing(req).sent)
    assert slim.prompt_tokens == original.prompt_tokens and slim.layout == original.layout
    rebuilt = restore(for_wire(slim), req.messages)
    assert rebuilt.messages == original.messages
    body = encode(for_wire(slim))  # no caller text; the service's own parts and a few bytes a message
    assert b"word " not in body and b"ibex-image" not in body
    assert len(body) < 8_000 + 200 * len(slim.history) + 8 * len(convo)


def test_a_layout_that_does_not_fit_the_conversation_is_internal() -> None:
    with pytest.raises(Internal, match=r"messages\.1 refers to message 5 of 1"):
        materialize(ChatLayout(messages=[0, 5]), [{"role": "user", "content": "q"}])
    with pytest.raises(Internal, match="block 3 of 1"):
        materialize(ChatLayout(messages=[Placed(ref=0, content=[Piece(ref=3)])]), [{"role": "user", "content": "q"}])
    resp = _run(_req([{"role": "user", "content": "q"}]))
    with pytest.raises(Internal, match="no layout"):
        restore(resp.model_copy(update={"layout": None}), [{"role": "user", "content": "q"}])
    for bad in ({}, {"ref": 1, "text": "x"}):
        with pytest.raises(ValidationError):
            Piece.model_validate(bad)
    for bad_placed in ({"ref": 1}, {"role": "system"}, {"ref": 1, "role": "system", "text": "x", "content": []}):
        with pytest.raises(ValidationError):
            Placed.model_validate(bad_placed)


def test_the_size_limits_fit_the_largest_window_in_the_catalog() -> None:
    window = max(m.context_window for m in CATALOG.models.values())
    limits = Settings()
    assert limits.max_request_bytes == window * WIRE_BYTES_PER_TOKEN == 16 << 20  # gemini-1.5-pro, 2M tokens
    assert limits.max_reply_bytes > 2 * limits.max_request_bytes  # a flat reply holds its history twice
    assert Settings(max_request_bytes=1 << 20).max_reply_bytes == (2 << 20) + (4 << 20)
    assert Settings(max_request_bytes=1 << 20, max_reply_bytes=1 << 20).max_reply_bytes == 1 << 20
