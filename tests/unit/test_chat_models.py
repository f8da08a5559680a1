"""pipeline.conversation: provider conversations parse strictly, round-trip unchanged, and every refusal
names the exact path (docs/protocol.md "Errors")."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ibex_context.pipeline.conversation.base import MAX_JSON_DEPTH, MAX_TEXT, MAX_TOOLS
from ibex_context.pipeline.conversation.parse import (
    message_text,
    parse_conversation,
    text_of,
    to_wire,
    tool_call_ids,
    tool_result_ids,
    wire_system,
    wire_tools,
)
from ibex_context.shared.wire.errors import InvalidRequest

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get current temperature for a given location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"], "additionalProperties": False},
    "strict": True}}

# A turn as in OpenAI's function-calling and vision guides
# (https://platform.openai.com/docs/guides/function-calling, .../guides/images-vision).
OPENAI_TURN: list[dict[str, Any]] = [
    {"role": "developer", "content": "You are a terse weather assistant."},
    {"role": "system", "content": [{"type": "text", "text": "Answer in Celsius."}], "name": "policy"},
    {"role": "user", "name": "alice", "content": [
        {"type": "text", "text": "What's the weather like in Paris today? And what is in this image?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-abc123"}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_12345xyz", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris, France\"}"}},
        {"id": "call_67890abc", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"location\":\"Bogotá, Colombia\"}"}}]},
    {"role": "tool", "tool_call_id": "call_12345xyz", "content": "14"},
    {"role": "tool", "tool_call_id": "call_67890abc", "content": [{"type": "text", "text": "19"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Paris 14°C, Bogotá 19°C."},
                                      {"type": "refusal", "refusal": "I can't identify people."}]},
    {"role": "user", "content": "Thanks"},
]

# A turn as in Anthropic's tool-use, vision, PDF, citations and extended-thinking guides
# (https://docs.anthropic.com/en/docs/build-with-claude/...).
ANTHROPIC_SYSTEM = [{"type": "text", "text": "You are a helpful analyst.", "cache_control": {"type": "ephemeral"}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the current weather in a given location",
                    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                                     "required": ["location"]},
                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
ANTHROPIC_TURN: list[dict[str, Any]] = [
    {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/ant.jpg"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
         "title": "Report", "context": "Q3", "citations": {"enabled": True}, "cache_control": {"type": "ephemeral"}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The grass is green."}},
        {"type": "text", "text": "What's the weather like in San Francisco?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants the weather; call the tool.", "signature": "EqQBCgIYAhIM"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"},
        {"type": "text", "text": "The grass is green.", "citations": [
            {"type": "char_location", "cited_text": "The grass is green.", "document_index": 1,
             "document_title": None, "start_char_index": 0, "end_char_index": 19}]},
        {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
         "input": {"location": "San Francisco, CA"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
         "content": [{"type": "text", "text": "15 degrees"},
                     {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": PNG}}],
         "is_error": False},
        {"type": "text", "text": "Also, is it windy?"}]},
    {"role": "assistant", "content": "It is 15 degrees and"},
]


def refused(fmt: str, messages: Any, **kw: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_conversation(fmt, messages, **kw)  # type: ignore[arg-type]
    assert info.value.message.startswith(f"{info.value.field}: ")  # the one-line message names its path
    return info.value


def test_openai_turn_round_trips_unchanged() -> None:
    conv = parse_conversation("openai", copy.deepcopy(OPENAI_TURN), tools=[WEATHER_TOOL])
    assert to_wire(conv) == OPENAI_TURN
    assert wire_tools(conv) == [WEATHER_TOOL]
    assert wire_system(conv) is None
    assert "detail" not in to_wire(conv)[2]["content"][2]["image_url"]  # no default appears
    assert tool_call_ids(conv.messages[3]) == ("call_12345xyz", "call_67890abc")
    assert tool_result_ids(conv.messages[5]) == ("call_67890abc",)
    assert tool_call_ids(conv.messages[2]) == tool_result_ids(conv.messages[2]) == ()
    assert message_text(conv.messages[6]) == "Paris 14°C, Bogotá 19°C.\nI can't identify people."
    assert message_text(conv.messages[3]) == ""


def test_anthropic_turn_round_trips_unchanged() -> None:
    conv = parse_conversation("anthropic", copy.deepcopy(ANTHROPIC_TURN), system=copy.deepcopy(ANTHROPIC_SYSTEM),
                              tools=copy.deepcopy(ANTHROPIC_TOOLS))
    assert to_wire(conv) == ANTHROPIC_TURN
    assert wire_system(conv) == ANTHROPIC_SYSTEM
    assert wire_tools(conv) == ANTHROPIC_TOOLS
    assert tool_call_ids(conv.messages[1]) == ("toolu_01A09q90qw90lq917835lq9",)
    assert tool_result_ids(conv.messages[2]) == ("toolu_01A09q90qw90lq917835lq9",)
    first, tool_turn = conv.messages[0].content, conv.messages[2].content
    assert isinstance(first, list) and isinstance(tool_turn, list)
    assert [text_of(b) for b in first] == ["", "", "", "The grass is green.",
                                           "What's the weather like in San Francisco?"]
    assert text_of(tool_turn[0]) == "15 degrees\n"
    assert message_text(conv.messages[1]).startswith("The user wants the weather; call the tool.\n\nThe grass")
    brief = parse_conversation("anthropic", [{"role": "user", "content": "hi"}], system="Be brief.")
    assert brief.system == wire_system(brief) == "Be brief."


OPENAI_ERRORS: list[tuple[list[Any], dict[str, Any], str, str]] = [
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}], {}, "messages.0.content.0.type",
     "unknown content part type 'video_url' (expected text, image_url, input_audio, file)"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "messages.0.content.0.type", "a system message cannot hold a 'image_url' content part (allowed: text)"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "messages.0.content.0.type", "an assistant message cannot hold a 'image_url'"),
    ([{"role": "user", "content": "a"}, {"role": "function", "name": "f", "content": "x"}], {}, "messages.1.role",
     "unknown role 'function'"),
    ([{"role": "user", "content": [{"text": "no type"}]}], {}, "messages.0.content.0.type", "missing type"),
    ([{"role": "user", "content": 7}], {}, "messages.0.content", "must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "ultra"}}]}], {},
     "messages.0.content.0.image_url.detail", "'auto', 'low' or 'high'"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "ogg"}}]}], {},
     "messages.0.content.0.input_audio.format", "'wav' or 'mp3'"),
    ([{"role": "user", "content": [{"type": "file", "file": {"filename": "a.pdf"}}]}], {},
     "messages.0.content.0.file", "needs file_id or file_data"),
    ([{"role": "user", "content": "x", "name": "Alice Smith"}], {}, "messages.0.name", "pattern"),
    ([{"role": "user", "content": "x", "tool_calls": []}], {}, "messages.0.tool_calls", "Extra inputs"),
    ([{"role": "assistant"}], {}, "messages.0.content", "needs content unless it has tool_calls"),
    ([], {}, "messages", "at least 1 item"),
    ([{"role": "user", "content": "x"}], {"system": "s"}, "system", "system or developer messages"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools.0.function.name", "pattern"),
    ([{"role": "user", "content": "x"}],
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": [1, float("inf")]}}}]},
     "tools.0.function.parameters.a.1", "NaN and infinity"),
    ([{"role": "user", "content": "x"}],
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": b"bin"}}}]},
     "tools.0.function.parameters.a", "not a JSON value"),
]


def _call(cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}


OPENAI_PAIRING: list[tuple[list[Any], str, str]] = [
    ([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}],
     "messages.1.tool_call_id", "answers no tool call"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1")]}],
     "messages.1.tool_calls.0.id", "'c1' has no tool message answering it before the conversation ends"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1"), _call("c2")]},
      {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "user", "content": "next"}],
     "messages.1.tool_calls.1.id", "'c2' has no tool message answering it before messages.3"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1")]},
      {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}],
     "messages.3.tool_call_id", "already answered"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1"), _call("c1")]}],
     "messages.1.tool_calls.1.id", "duplicate tool call id 'c1'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("c1")]},
      {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "assistant", "tool_calls": [_call("c1")]}],
     "messages.3.tool_calls.0.id", "duplicate"),
]


@pytest.mark.parametrize(("messages", "kw", "field", "words"), OPENAI_ERRORS)
def test_openai_refusals_name_the_path(messages: list[Any], kw: dict[str, Any], field: str, words: str) -> None:
    err = refused("openai", messages, **kw)
    assert err.field == field
    assert words in err.message


@pytest.mark.parametrize(("messages", "field", "words"), OPENAI_PAIRING)
def test_openai_tool_pairing(messages: list[Any], field: str, words: str) -> None:
    err = refused("openai", messages)
    assert (err.field, words in err.message) == (field, True), err.message


def _use(uid: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": uid, "name": "f", "input": {}}


def _result(uid: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": uid, "content": "ok"}


ANTHROPIC_ERRORS: list[tuple[list[Any], dict[str, Any], str, str]] = [
    ([{"role": "user", "content": [{"type": "video", "source": {}}]}], {}, "messages.0.content.0.type",
     "unknown content block type 'video' (expected text, image, document, tool_result)"),
    ([{"role": "user", "content": [_use("a")]}], {}, "messages.0.content.0.type",
     "a user message cannot hold a 'tool_use' content block"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_result("a")]}], {},
     "messages.1.content.0.type", "an assistant message cannot hold a 'tool_result'"),
    ([{"role": "system", "content": "x"}], {}, "messages.0.role", "takes the system prompt in 'system'"),
    ([{"role": "assistant", "content": "x"}], {}, "messages.0.role", "first message must be a user message"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                                                 "data": "x"}}]}], {},
     "messages.0.content.0.source.media_type", "image/jpeg"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}], {},
     "messages.0.content.0.source.type", "unknown source type 'file' (expected base64, url)"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s", "cache_control": {"type": "ephemeral"}}]}], {},
     "messages.1.content.0.cache_control", "Extra inputs"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}], {},
     "messages.0.content.0.cache_control.type", "'ephemeral'"),
    ([{"role": "user", "content": []}, {"role": "assistant", "content": "a"}], {}, "messages.0.content",
     "must not be empty"),
    ([{"role": "user", "content": "q"}], {"system": [{"type": "image", "source": {}}]}, "system.0.type",
     "unknown content block type 'image' (expected text)"),
    ([{"role": "user", "content": "q"}], {"tools": [{"name": "f"}]}, "tools.0.input_schema", "Field required"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "bad id!", "name": "f", "input": {}}]}], {}, "messages.1.content.0.id", "pattern"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": []}]}], {}, "messages.1.content.0.input",
     "valid dictionary"),
]

ANTHROPIC_PAIRING: list[tuple[list[Any], str, str]] = [
    ([{"role": "user", "content": [_result("a")]}], "messages.0.content.0.tool_use_id",
     "no tool_use 'a' in the assistant message just before it"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a")]}],
     "messages.1.content.0.id", "'a' has no tool_result answering it before the conversation ends"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a"), _use("b")]},
      {"role": "user", "content": [_result("a")]}], "messages.1.content.1.id", "'b' has no tool_result answering it"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a")]},
      {"role": "assistant", "content": "more"}, {"role": "user", "content": [_result("a")]}],
     "messages.1.content.0.id", "in messages.2"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a")]},
      {"role": "user", "content": [_result("a"), _result("a")]}], "messages.2.content.1.tool_use_id",
     "answered twice"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a")]},
      {"role": "user", "content": [{"type": "text", "text": "here"}, _result("a")]}], "messages.2.content.1.type",
     "must come before every other block"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [_use("a"), _use("a")]}],
     "messages.1.content.1.id", "duplicate tool_use id 'a'"),
]


@pytest.mark.parametrize(("messages", "kw", "field", "words"), ANTHROPIC_ERRORS)
def test_anthropic_refusals_name_the_path(messages: list[Any], kw: dict[str, Any], field: str, words: str) -> None:
    err = refused("anthropic", messages, **kw)
    assert err.field == field
    assert words in err.message


@pytest.mark.parametrize(("messages", "field", "words"), ANTHROPIC_PAIRING)
def test_anthropic_tool_pairing(messages: list[Any], field: str, words: str) -> None:
    err = refused("anthropic", messages)
    assert (err.field, words in err.message) == (field, True), err.message


def test_anthropic_rules_the_api_allows() -> None:
    """Consecutive same-role turns (the API combines them) and an empty final prefill pass."""
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"}, {"role": "assistant", "content": ""}]
    assert to_wire(parse_conversation("anthropic", copy.deepcopy(msgs))) == msgs


def test_limits() -> None:
    user = {"role": "user", "content": "x"}
    assert refused("openai", [user] * 10_001).field == "messages"
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS + 1)]
    assert refused("openai", [user], tools=tools).field == "tools"
    assert parse_conversation("openai", [user], tools=tools[:MAX_TOOLS]).tools is not None
    assert refused("openai", [{"role": "user", "content": "x" * (MAX_TEXT + 1)}]).field == "messages.0.content"
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(MAX_JSON_DEPTH):
        cur["a"] = {}
        cur = cur["a"]
    err = refused("anthropic", [user], tools=[{"name": "f", "input_schema": deep}])
    assert err.field is not None and err.field.startswith("tools.0.input_schema.a.a")
    assert "deeper than 32" in err.message
    assert refused("chat", [user]).field == "format"  # type: ignore[arg-type]


def test_json_depth_boundary() -> None:
    ok: dict[str, Any] = {}
    cur = ok
    for _ in range(MAX_JSON_DEPTH - 2):  # the tool input itself is level 1
        cur["a"] = {}
        cur = cur["a"]
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": ok}]},
            {"role": "user", "content": [_result("a")]}]
    parse_conversation("anthropic", msgs)
    cur["a"] = {"b": 1}
    assert "deeper than 32" in refused("anthropic", msgs).message


# ------------------------------------------------------------------ generated conversations

words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)
ids = st.integers(0, 10**6)


@st.composite
def openai_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Valid OpenAI conversations: optional system/developer, user turns with text and images,
    assistant turns with parallel tool calls answered (in any order) by tool messages."""
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(words)})
    next_id = draw(ids)
    for _ in range(draw(st.integers(1, 5))):
        image = {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": draw(
            st.sampled_from(["auto", "low", "high"]))}}
        msgs.append({"role": "user", "content": draw(st.sampled_from(
            [draw(words), [{"type": "text", "text": draw(words)}, image]]))})
        n_calls = draw(st.integers(0, 3))
        call_ids = [f"call_{next_id + k}" for k in range(n_calls)]
        next_id += n_calls
        if call_ids:
            calls = [{"id": c, "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}
                     for c in call_ids]
            msgs.append({"role": "assistant", "content": draw(st.sampled_from([None, draw(words)])),
                         "tool_calls": calls})
            msgs.extend({"role": "tool", "tool_call_id": c, "content": draw(words)}
                        for c in draw(st.permutations(call_ids)))
        if not call_ids or draw(st.booleans()):
            msgs.append({"role": "assistant", "content": draw(words)})
    return msgs


@st.composite
def anthropic_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Valid Anthropic conversations: user turns with text and images, assistant turns with
    thinking, text and parallel tool_use blocks answered first thing in the next user turn."""
    msgs: list[dict[str, Any]] = []
    next_id = draw(ids)
    for _ in range(draw(st.integers(1, 5))):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        tail = draw(st.sampled_from([[], [{"type": "text", "text": draw(words)}], [image]]))
        if msgs and msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], list):
            uses = [b["id"] for b in msgs[-1]["content"] if b["type"] == "tool_use"]
            results = [{"type": "tool_result", "tool_use_id": u, "content": draw(words)}
                       for u in draw(st.permutations(uses))]
            msgs.append({"role": "user", "content": results + tail} if results + tail else
                        {"role": "user", "content": draw(words)})
        else:
            msgs.append({"role": "user", "content": draw(st.sampled_from([draw(words), [image, *tail]]))})
        n_calls = draw(st.integers(0, 3))
        blocks: list[dict[str, Any]] = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(words), "signature": "c2ln"})
        if draw(st.booleans()):
            blocks.append({"type": "text", "text": draw(words)})
        blocks += [{"type": "tool_use", "id": f"toolu_{next_id + k}", "name": "lookup", "input": {"q": k}}
                   for k in range(n_calls)]
        next_id += n_calls
        msgs.append({"role": "assistant", "content": blocks or draw(words)})
    if any(b["type"] == "tool_use" for b in msgs[-1]["content"] if isinstance(msgs[-1]["content"], list)):
        uses = [b["id"] for b in msgs[-1]["content"] if b["type"] == "tool_use"]
        msgs.append({"role": "user", "content": [_result(u) for u in uses]})
    return msgs


def _all_calls(fmt: str, msgs: list[dict[str, Any]]) -> list[str]:
    return [c for m in parse_conversation(fmt, msgs).messages for c in tool_call_ids(m)]  # type: ignore[arg-type]


@given(openai_conversations())
def test_generated_openai_parse_and_round_trip(msgs: list[dict[str, Any]]) -> None:
    conv = parse_conversation("openai", copy.deepcopy(msgs))
    assert to_wire(conv) == msgs
    calls = [c for m in conv.messages for c in tool_call_ids(m)]
    assert sorted(calls) == sorted(r for m in conv.messages for r in tool_result_ids(m))


@given(anthropic_conversations())
def test_generated_anthropic_parse_and_round_trip(msgs: list[dict[str, Any]]) -> None:
    conv = parse_conversation("anthropic", copy.deepcopy(msgs))
    assert to_wire(conv) == msgs
    calls = [c for m in conv.messages for c in tool_call_ids(m)]
    assert sorted(calls) == sorted(r for m in conv.messages for r in tool_result_ids(m))


@given(openai_conversations(), st.data())
def test_openai_orphan_call_refused(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    assume(tools)
    gone = msgs.pop(data.draw(st.sampled_from(tools)))["tool_call_id"]
    err = refused("openai", msgs)
    assert err.field is not None and err.field.endswith(".id") and repr(gone) in err.message


@given(openai_conversations(), st.data())
def test_openai_orphan_result_refused(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    callers = [i for i, m in enumerate(msgs) if m.get("tool_calls")]
    assume(callers)
    i = data.draw(st.sampled_from(callers))
    calls = msgs[i]["tool_calls"]
    gone = calls.pop(data.draw(st.integers(0, len(calls) - 1)))["id"]
    if not calls:
        del msgs[i]["tool_calls"]
        if msgs[i]["content"] is None:
            del msgs[i]
    err = refused("openai", msgs)
    assert err.field is not None and err.field.endswith(".tool_call_id") and repr(gone) in err.message


def _drop_block(msgs: list[dict[str, Any]], i: int, k: int) -> dict[str, Any]:
    block: dict[str, Any] = msgs[i]["content"].pop(k)
    if not msgs[i]["content"]:
        del msgs[i]
    return block


def _blocks(msgs: list[dict[str, Any]], kind: str) -> list[tuple[int, int]]:
    return [(i, k) for i, m in enumerate(msgs) if isinstance(m["content"], list)
            for k, b in enumerate(m["content"]) if b["type"] == kind]


@given(anthropic_conversations(), st.data())
def test_anthropic_orphan_call_refused(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    where = _blocks(msgs, "tool_result")
    assume(where)
    gone = _drop_block(msgs, *data.draw(st.sampled_from(where)))["tool_use_id"]
    err = refused("anthropic", msgs)
    assert err.field is not None and err.field.endswith(".id") and repr(gone) in err.message


@given(anthropic_conversations(), st.data())
def test_anthropic_orphan_result_refused(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    where = _blocks(msgs, "tool_use")
    assume(where)
    gone = _drop_block(msgs, *data.draw(st.sampled_from(where)))["id"]
    err = refused("anthropic", msgs)
    assert err.field is not None and err.field.endswith(".tool_use_id") and repr(gone) in err.message
