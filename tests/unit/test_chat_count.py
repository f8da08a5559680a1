"""Provider-faithful prompt counting (pipeline/counting/chat_count.py, pipeline/counting/image_tokens.py).

The worked examples are the providers' own published numbers: the OpenAI cookbook's message and
tool examples (counted there against the live API), OpenAI's vision cost examples, Anthropic's
vision cost table. The images are real headers built here byte by byte.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.counting.chat_count import (
    anthropic_image_tokens,
    anthropic_prompt_tokens,
    anthropic_tools_tokens,
    image_size,
    openai_image_tokens,
    openai_message_tokens,
    openai_prompt_tokens,
    openai_tools_tokens,
)
from ibex_context.pipeline.counting.image_tokens import ANTHROPIC_IMAGE_CAP, openai_patches, sniff_size
from ibex_context.shared.wire.errors import InvalidRequest

CATALOG = Catalog.load()
O200K = CATALOG.counter("o200k")
CL100K = CATALOG.counter("cl100k")
CLAUDE = CATALOG.counter("claude")

# --- the OpenAI cookbook, "How to count tokens with tiktoken", sections 6 and 7 ------------------
COOKBOOK_MESSAGES = [
    {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate "
                                  "jargon into plain English."},
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
    {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch "
                                                          "base on opportunities for increased leverage."},
    {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to "
                                                               "do better."},
    {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client "
                                "deliverable."},
]
COOKBOOK_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "description": "The unit of temperature to return",
                         "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}]
COOKBOOK_TOOL_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that can answer to questions about the weather."},
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


@pytest.mark.parametrize(("model", "counter", "published"), [
    ("gpt-3.5-turbo", CL100K, 129), ("gpt-4", CL100K, 129), ("gpt-4o", O200K, 124), ("gpt-4o-mini", O200K, 124),
])
def test_cookbook_messages_example(model: str, counter: Any, published: int) -> None:
    assert openai_prompt_tokens(COOKBOOK_MESSAGES, [], counter, model=model) == published


@pytest.mark.parametrize(("model", "counter", "published"), [
    ("gpt-3.5-turbo", CL100K, 105), ("gpt-4", CL100K, 105), ("gpt-4o", O200K, 101), ("gpt-4o-mini", O200K, 101),
])
def test_cookbook_tools_example(model: str, counter: Any, published: int) -> None:
    assert openai_prompt_tokens(COOKBOOK_TOOL_MESSAGES, COOKBOOK_TOOLS, counter, model=model) == published


def test_tool_constants_follow_the_model_name_as_sdks_send_it() -> None:
    gpt4o = openai_tools_tokens(COOKBOOK_TOOLS, O200K, model="gpt-4o")
    assert openai_tools_tokens(COOKBOOK_TOOLS, O200K, model="OpenAI/GPT-4o-2024-08-06") == gpt4o
    # a model the cookbook does not list gets the larger func_init (10, not 7)
    assert openai_tools_tokens(COOKBOOK_TOOLS, O200K, model="gpt-4.1") == gpt4o + 3
    assert openai_tools_tokens([], O200K, model="gpt-4o") == 0


def test_schema_parts_the_cookbook_ignores_are_charged() -> None:
    nested = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"q": {"type": "object", "description": "x",
                                               "properties": {"deep": {"type": "string"}}}}}}}
    flat = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"q": {"type": "object", "description": "x"}}}}}
    extra = O200K.count(cc.canonical_json({"properties": {"deep": {"type": "string"}}}))
    flat_n = openai_tools_tokens([flat], O200K, model="gpt-4o")
    assert openai_tools_tokens([nested], O200K, model="gpt-4o") == flat_n + extra


def test_assistant_tool_calls_and_tool_results() -> None:
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_current_weather", "arguments": '{"location":"Paris, FR"}'}}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    c = O200K.count
    expected = (cc.TOKENS_PER_MESSAGE + c("assistant") + cc.TOOL_CALL_OVERHEAD + c("call_abc123")
                + c("get_current_weather") + c('{"location":"Paris, FR"}'))
    assert openai_message_tokens(assistant, O200K, model="gpt-4o") == expected
    result = {"role": "tool", "tool_call_id": "call_abc123", "content": "18C and sunny"}
    assert openai_message_tokens(result, O200K, model="gpt-4o") == (
        cc.TOKENS_PER_MESSAGE + c("tool") + c("call_abc123") + c("18C and sunny"))


# --- images: tiny real files -----------------------------------------------------------------------


def png(width: int, height: int) -> bytes:
    """A real RGB PNG (signature, IHDR, zlib IDAT, IEND) per the PNG spec."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + b"\x00" * 3 * width for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def gif(width: int, height: int) -> bytes:
    """GIF89a: screen descriptor, no colour table, one image descriptor, a minimal LZW stream."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)
    image = b"," + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return screen + image + b";"


def jpeg(width: int, height: int, *, app_padding: int = 0) -> bytes:
    """SOI, JFIF APP0, an optional large APP1 (EXIF-like), SOF0 with the size, EOI."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    app1 = b"\xff\xe1" + struct.pack(">H", app_padding + 2) + b"\x00" * app_padding if app_padding else b""
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + app1 + sof0 + b"\xff\xd9"


def webp(width: int, height: int, kind: str) -> bytes:
    """RIFF/WEBP with a VP8 (lossy), VP8L (lossless) or VP8X (extended) first chunk."""
    if kind == "VP8 ":
        body = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    elif kind == "VP8L":
        body = b"\x2f" + ((width - 1) | (height - 1) << 14).to_bytes(4, "little")
    else:
        body = b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunk = kind.encode() + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


REAL_WEBP_1X1 = "UklGRhoAAABXRUJQVlA4TA0AAAAvAAAAEAcQERGIiP4HAA=="  # a complete lossless 1x1 WebP


def openai_part(data: bytes, mime: str, detail: str = "high") -> dict[str, Any]:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def anthropic_block(data: bytes, mime: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": mime,
                                        "data": base64.b64encode(data).decode()}}


@pytest.mark.parametrize(("data", "mime", "size"), [
    (png(3, 2), "image/png", (3, 2)),
    (png(1024, 1), "image/png", (1024, 1)),
    (gif(640, 480), "image/gif", (640, 480)),
    (jpeg(1800, 2400), "image/jpeg", (1800, 2400)),
    (jpeg(4000, 3000, app_padding=20000), "image/jpeg", (4000, 3000)),  # frame past the first 4 KiB
    (jpeg(640, 480, app_padding=60000), "image/jpeg", (640, 480)),  # and past the first 64 KiB of base64
    (webp(1000, 700, "VP8 "), "image/webp", (1000, 700)),
    (webp(1000, 700, "VP8L"), "image/webp", (1000, 700)),
    (webp(5000, 7000, "VP8X"), "image/webp", (5000, 7000)),
    (base64.b64decode(REAL_WEBP_1X1), "image/webp", (1, 1)),
])
def test_image_size_from_base64_headers(data: bytes, mime: str, size: tuple[int, int]) -> None:
    assert sniff_size(data) == size
    assert image_size(openai_part(data, mime)) == size
    assert image_size(anthropic_block(data, mime)) == size


def test_image_size_unknown_for_urls_files_and_garbage() -> None:
    assert image_size({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}) is None
    assert image_size({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}) is None
    assert image_size({"type": "image", "source": {"type": "file", "file_id": "file_1"}}) is None
    assert image_size(openai_part(b"not an image at all", "image/png")) is None
    assert image_size({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}) is None
    assert image_size(openai_part(png(0, 5)[:24], "image/png")) is None  # zero width is not a size
    assert image_size(openai_part(jpeg(640, 480, app_padding=60000)[:-15], "image/jpeg")) is None  # no frame


@pytest.mark.parametrize(("size", "detail", "model", "published"), [
    ((1024, 1024), "high", "gpt-4o", 765),  # 4 tiles * 170 + 85
    ((2048, 4096), "high", "gpt-4o", 1105),  # 1024x2048 -> 768x1536: 6 tiles
    ((4096, 8192), "low", "gpt-4o", 85),
    ((2048, 4096), "auto", "gpt-4.1", 1105),
    ((1024, 1024), "high", "gpt-4o-mini", 2833 + 4 * 5667),
    ((1024, 1024), "high", "o3", 75 + 4 * 150),
    ((128, 64), "high", "gpt-4o", 255),  # small images are not scaled up: one tile
    ((1024, 1024), "low", "gpt-4.1-mini", 1659),  # 1024 patches * 1.62, detail is not in the formula
    ((1800, 2400), "high", "gpt-4.1-nano", 3572),  # 1452 patches * 2.46
])
def test_openai_image_examples(size: tuple[int, int], detail: str, model: str, published: int) -> None:
    assert openai_image_tokens(*size, detail, model=model) == published


def test_openai_patch_examples() -> None:
    assert openai_patches(1024, 1024) == 1024
    assert openai_patches(1800, 2400) == 1452  # the docs' worked example: 33 x 44 patches


@given(st.integers(1, 20000), st.integers(1, 20000), st.sampled_from(["gpt-4o", "gpt-4o-mini", "o3", "gpt-4.1-mini"]))
def test_openai_unknown_size_is_the_maximum(width: int, height: int, model: str) -> None:
    for detail in ("low", "high", "auto"):
        assert openai_image_tokens(width, height, detail, model=model) <= openai_image_tokens(
            None, None, detail, model=model)
    assert openai_image_tokens(None, None, "high", model="gpt-4o") == 85 + 8 * 170


def test_openai_unknown_model_gets_the_largest_constants() -> None:
    assert openai_image_tokens(1024, 1024, "high", model="gpt-9") == 2833 + 4 * 5667


@pytest.mark.parametrize(("size", "published"), [
    ((200, 200), 54), ((1000, 1000), 1334), ((1092, 1092), 1590),  # the cost table
    ((951, 1268), 1608), ((896, 1344), 1606), ((819, 1456), 1590), ((784, 1568), 1640),  # the no-resize sizes
])
def test_anthropic_image_examples(size: tuple[int, int], published: int) -> None:
    assert anthropic_image_tokens(*size) == published


@given(st.integers(1, 8000), st.integers(1, 8000))
def test_anthropic_images_are_capped(width: int, height: int) -> None:
    assert 0 < anthropic_image_tokens(width, height) <= ANTHROPIC_IMAGE_CAP == anthropic_image_tokens(None, None)


def test_image_parts_in_messages() -> None:
    part = openai_part(png(1024, 1024), "image/png")
    msg = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}
    assert openai_message_tokens(msg, O200K, model="gpt-4o") == 3 + O200K.count("user") + O200K.count(
        "What is this?") + 765
    url = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}
    assert openai_message_tokens(url, O200K, model="gpt-4o") == 3 + O200K.count("user") + 1445
    block = {"role": "user", "content": [anthropic_block(png(200, 200), "image/png")]}
    assert anthropic_prompt_tokens(None, [block], [], CLAUDE) == cc.MESSAGE_OVERHEAD + 54


# --- refusals name the path ------------------------------------------------------------------------


def test_parts_we_cannot_count_are_refused_by_path() -> None:
    audio = {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
    with pytest.raises(InvalidRequest) as err:
        openai_prompt_tokens([{"role": "user", "content": "a"}, audio], [], O200K, model="gpt-4o")
    assert err.value.field == "messages.1.content.1" and err.value.message.startswith("messages.1.content.1: ")
    pdf = {"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}
    with pytest.raises(InvalidRequest, match=r"^messages\.0\.content\.0: ") as err:
        anthropic_prompt_tokens(None, [pdf], [], CLAUDE)
    with pytest.raises(InvalidRequest, match="unknown content part type 'video'"):
        openai_message_tokens({"role": "user", "content": [{"type": "video"}]}, O200K, model="gpt-4o")


# --- Anthropic -------------------------------------------------------------------------------------

WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a given location",
                "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                                 "required": ["location"]}}


def test_anthropic_tools_add_the_published_system_prompt() -> None:
    definition = cc.TOOL_DEFINITION_OVERHEAD + CLAUDE.count(cc.canonical_json(WEATHER_TOOL))
    assert anthropic_tools_tokens([], CLAUDE, model="claude-sonnet-4") == 0
    assert anthropic_tools_tokens([WEATHER_TOOL], CLAUDE, model="claude-sonnet-4-20250514") == 346 + definition
    assert anthropic_tools_tokens([WEATHER_TOOL], CLAUDE, model="claude-3-5-haiku") == 340 + definition
    assert anthropic_tools_tokens([WEATHER_TOOL], CLAUDE) == 530 + definition  # unknown: the largest figure
    cached = {**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}
    assert anthropic_tools_tokens([cached], CLAUDE) == 530 + definition
    bash = {"type": "bash_20250124", "name": "bash"}
    assert anthropic_tools_tokens([bash], CLAUDE) >= 530 + cc.ANTHROPIC_TYPED_TOOL_ALLOWANCE


def test_anthropic_blocks() -> None:
    use = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"location": "Paris", "unit": "c"}}
    reordered = {**use, "input": {"unit": "c", "location": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01",
              "content": [{"type": "text", "text": "18C"}, anthropic_block(png(1000, 1000), "image/png")]}
    thinking = {"type": "thinking", "thinking": "The user wants weather.", "signature": "c2ln"}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [thinking, use]},
            {"role": "user", "content": [result]}]
    c = CLAUDE.count
    expected = (3 * cc.MESSAGE_OVERHEAD + c("Weather in Paris?") + c("The user wants weather.")
                + cc.TOOL_USE_OVERHEAD + c("toolu_01") + c("get_weather") + c('{"location":"Paris","unit":"c"}')
                + cc.TOOL_RESULT_OVERHEAD + c("toolu_01") + c("18C") + 1334)
    assert anthropic_prompt_tokens(None, msgs, [], CLAUDE) == expected
    msgs[1] = {"role": "assistant", "content": [thinking, reordered]}
    assert anthropic_prompt_tokens(None, msgs, [], CLAUDE) == expected  # key order does not matter
    system = [{"type": "text", "text": "Be brief."}]
    assert anthropic_prompt_tokens(system, msgs, [], CLAUDE) == expected + cc.MESSAGE_OVERHEAD + c("Be brief.")
    text_doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Doc body"},
                "title": "T"}
    assert anthropic_prompt_tokens("", [{"role": "user", "content": [text_doc]}], [], CLAUDE) == (
        cc.MESSAGE_OVERHEAD + c("Doc body") + c("T"))
    cite = [{"type": "char_location", "cited_text": "Doc", "document_index": 0, "start_char_index": 0,
             "end_char_index": 3}]
    cited = {"role": "assistant", "content": [{"type": "text", "text": "It says Doc.", "citations": cite}]}
    assert anthropic_prompt_tokens(None, [cited], [], CLAUDE) == (
        cc.MESSAGE_OVERHEAD + c("It says Doc.") + c(cc.canonical_json(cite)))


# --- properties ------------------------------------------------------------------------------------

TEXT = st.text(max_size=40)
IDS = st.from_regex(r"call_[A-Za-z0-9]{4,12}", fullmatch=True)


@st.composite
def openai_messages(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    msg: dict[str, Any] = {"role": role}
    if role == "assistant" and draw(st.booleans()):
        msg["content"] = None
        msg["tool_calls"] = [{"id": draw(IDS), "type": "function",
                              "function": {"name": draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True)),
                                           "arguments": draw(TEXT)}} for _ in range(draw(st.integers(1, 3)))]
    elif draw(st.booleans()):
        msg["content"] = [{"type": "text", "text": t} for t in draw(st.lists(TEXT, min_size=1, max_size=3))]
    else:
        msg["content"] = draw(TEXT)
    if role == "tool":
        msg["tool_call_id"] = draw(IDS)
    elif draw(st.booleans()):
        msg["name"] = draw(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
    return msg


def openai_texts(msg: dict[str, Any]) -> list[str]:
    texts = [v for k, v in msg.items() if isinstance(v, str)]
    if isinstance(msg.get("content"), list):
        texts += [p["text"] for p in msg["content"]]
    for call in msg.get("tool_calls") or ():
        texts += [call["id"], call["function"]["name"], call["function"]["arguments"]]
    return texts


@given(st.lists(openai_messages(), max_size=6), openai_messages(), st.sampled_from(["gpt-4o", "gpt-4"]))
def test_openai_count_grows_and_covers_its_texts(msgs: list[dict[str, Any]], extra: dict[str, Any],
                                                 model: str) -> None:
    counter = O200K if model == "gpt-4o" else CL100K
    before = openai_prompt_tokens(msgs, [], counter, model=model)
    after = openai_prompt_tokens([*msgs, extra], [], counter, model=model)
    assert after > before >= 0
    assert before >= sum(counter.count(t) for m in msgs for t in openai_texts(m))
    assert after == before + openai_message_tokens(extra, counter, model=model)


@st.composite
def anthropic_messages(draw: st.DrawFn) -> dict[str, Any]:
    blocks = st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, TEXT),
        st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "x"}, TEXT),
        st.builds(lambda i, n, v: {"type": "tool_use", "id": i, "name": n, "input": {"q": v}}, IDS, TEXT, TEXT),
        st.builds(lambda i, t: {"type": "tool_result", "tool_use_id": i, "content": t}, IDS, TEXT),
    )
    content = draw(st.one_of(TEXT, st.lists(blocks, min_size=1, max_size=3)))
    return {"role": draw(st.sampled_from(["user", "assistant"])), "content": content}


def anthropic_texts(msg: dict[str, Any]) -> list[str]:
    if isinstance(msg["content"], str):
        return [msg["content"]]
    keys = {"text": ["text"], "thinking": ["thinking"], "tool_use": ["id", "name"], "tool_result": ["tool_use_id",
                                                                                                    "content"]}
    return [b[k] for b in msg["content"] for k in keys[b["type"]]]


@given(st.lists(anthropic_messages(), max_size=6), anthropic_messages())
def test_anthropic_count_grows_and_covers_its_texts(msgs: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    # claude-opus-4-5 keeps earlier turns' thinking, so a new user turn frees none of it (the models
    # that strip it: tests/test_context_editing.py)
    before = anthropic_prompt_tokens("You are terse.", msgs, [WEATHER_TOOL], CLAUDE, model="claude-opus-4-5")
    after = anthropic_prompt_tokens("You are terse.", [*msgs, extra], [WEATHER_TOOL], CLAUDE,
                                    model="claude-opus-4-5")
    assert after > before >= 0
    assert before >= sum(CLAUDE.count(t) for m in msgs for t in anthropic_texts(m)) + CLAUDE.count("You are terse.")
