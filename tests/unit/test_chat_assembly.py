"""Chat-native assembly end to end through the one pipeline (offline) and the real stack.

The conversation goes in in the provider's shape and comes back ready to send: the directive and
the nonce-tagged memories placed, tool calls and images untouched, history trimmed in whole units,
and the exact count of the emitted prompt never over window - response reserve.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_chat_assembly.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation.history import latest_user_index
from ibex_context.pipeline.conversation.parse import parse_conversation
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.codec import decode_request, encode
from ibex_context.shared.wire.errors import ContextOverflow, ErrorCode, InvalidRequest
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse, ErrorReply
from tests.properties import examples

CATALOG = Catalog.load()
HITS = [MemoryHit(f"m{i}", f"memory {i}: the October invoice was sent to billing contact {i}", "fact",
                  0.95 - i / 100, 0.8, i + 1, "hot") for i in range(20)]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/receipt.png", "detail": "high"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "invoice"}'}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look up billing records",
                                           "parameters": {"type": "object",
                                                          "properties": {"q": {"type": "string"}}}}}]
AGENT_TURN = [
    {"role": "system", "content": "You are Acme's support agent."},
    {"role": "user", "content": [{"type": "text", "text": "Is this my invoice?"}, IMAGE]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "invoice #42 was sent on 3 October"},
    {"role": "assistant", "content": "Yes, invoice #42, sent on 3 October."},
    {"role": "user", "content": "And what's the amount?"},
]


def _req(messages: list[Any], *, model: str = "gpt-4o", fmt: str = "openai", **kw: Any) -> AssembleRequest:
    return AssembleRequest(request_id="r", org_id="acme", agent_id="support-bot", model=model, query="amount",
                           format=fmt, messages=messages, deadline_ns=1, **kw)  # type: ignore[arg-type]


def _run(req: AssembleRequest, directive: str | None = "Answer billing questions briefly.",
         hits: list[MemoryHit] = HITS) -> AssembleResponse:
    return assemble(req, offline_result(directive=directive, hot=hits, cold=[]), Engine(CATALOG, Policy()))


def _blocks(content: Any) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _without_memory_block(messages: list[dict[str, Any]], nonce: str) -> list[dict[str, Any]]:
    """The messages with the memory block taken out, every content as a block list. The block must
    be exactly one text block, in the latest user turn, after that turn's tool_result blocks only."""
    closing = f'</memories nonce="{nonce}">'
    where = [(i, j) for i, m in enumerate(messages) for j, b in enumerate(_blocks(m["content"]))
             if b.get("type") == "text" and closing in b.get("text", "")]
    assert len(where) == 1
    i, j = where[0]
    assert i == latest_user_index("anthropic", messages)
    blocks = _blocks(messages[i]["content"])
    assert all(b.get("type") == "tool_result" for b in blocks[:j])
    assert blocks[j]["text"].endswith(closing)
    return [{**m, "content": [b for k, b in enumerate(_blocks(m["content"])) if (n, k) != (i, j)]}
            for n, m in enumerate(messages)]


def _as_blocks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": _blocks(m["content"])} for m in messages]


def _limit(resp: AssembleResponse) -> int:
    return resp.budget.context_window - resp.budget.response_reserve


def test_openai_turn_with_tool_call_and_image_comes_back_ready_to_send() -> None:
    resp = _run(_req(AGENT_TURN, tools=TOOLS))
    out = resp.messages
    assert out is not None and resp.format == "openai" and resp.system is None
    assert [m["role"] for m in out] == ["system", "system", "user", "assistant", "tool", "assistant", "system",
                                        "user"]
    assert out[0] == AGENT_TURN[0] and out[1] == {"role": "system", "content": "Answer billing questions briefly."}
    assert out[2]["content"][1] == IMAGE and out[3]["tool_calls"] == [CALL]  # untouched
    memory = out[6]["content"]
    assert f'nonce="{resp.nonce}"' in memory and "October invoice" in memory and len(resp.packed) == 20
    assert out[-1] == AGENT_TURN[-1]
    counter = CATALOG.counter("o200k")
    assert resp.prompt_tokens == cc.openai_prompt_tokens(out, TOOLS, counter, model="gpt-4o")
    assert resp.prompt_tokens_kind == "exact" and resp.prompt_tokens <= _limit(resp)
    assert resp.history == []
    parse_conversation("openai", out, tools=TOOLS)  # what we emit is a valid conversation


def test_180k_token_conversation_is_trimmed_to_fit_with_decisions_and_fail_mode_overflows() -> None:
    big = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 1800} for i in range(100)]
    big.append({"role": "user", "content": "the latest question"})
    total = cc.openai_prompt_tokens(big, [], CATALOG.counter("o200k"), model="gpt-4o")
    assert total > 180_000
    resp = _run(_req(big))
    assert resp.prompt_tokens is not None and resp.prompt_tokens <= _limit(resp)
    assert resp.messages is not None and resp.messages[-1] == big[-1]
    dropped = [h.index for h in resp.history]
    assert dropped == list(range(len(dropped))) and len(dropped) >= 30  # the oldest went first
    assert all(h.reason.startswith(("trim_oldest", "start_on_user")) and h.tokens > 0 for h in resp.history)
    with pytest.raises(ContextOverflow) as info:
        _run(_req(big, history={"mode": "fail"}))
    assert info.value.code == ErrorCode.CONTEXT_OVERFLOW and "tokens over" in info.value.message


def test_latest_turn_alone_over_the_window_is_context_overflow() -> None:
    huge = [{"role": "user", "content": "word " * 140_000}]
    with pytest.raises(ContextOverflow, match=r"\d+ tokens over"):
        _run(_req(huge))


def test_anthropic_system_blocks_tool_use_kept_whole() -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant",
             "content": [{"type": "tool_use", "id": "tu1", "name": "lookup", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "ok"},
                                         {"type": "text", "text": "and the amount?"}]}]
    resp = _run(_req(msgs, model="anthropic/claude-sonnet-4", fmt="anthropic", system="Be kind.",
                     tools=[{"name": "lookup", "input_schema": {"type": "object"}}]))
    assert resp.system is not None and [b["text"][:8] for b in resp.system] == ["Be kind.", "Answer b"]
    assert resp.messages is not None and resp.messages[:2] == msgs[:2]  # earlier turns: the same objects
    assert _without_memory_block(resp.messages, resp.nonce) == _as_blocks(msgs)
    assert resp.messages[2]["content"][1]["text"].startswith("The block below")  # after the tool_result
    assert resp.prompt_tokens_kind == "estimate" and resp.prompt_tokens is not None
    assert resp.prompt_tokens <= _limit(resp)


def test_orphaned_tool_result_and_mixed_forms_are_invalid_requests_naming_the_path() -> None:
    orphan = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    with pytest.raises(InvalidRequest) as info:
        _run(_req(orphan))
    assert info.value.field is not None and info.value.field.startswith("messages.1")
    mixed = encode(_req([{"role": "user", "content": "hi"}]).model_copy(
        update={"format": None}))  # messages without format
    reply = decode_request(mixed)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INVALID_REQUEST
    assert "format" in reply.message


# --------------------------------------------------------------------------- properties

def _text(draw: Any, big: bool) -> str:
    return " ".join(draw(st.lists(st.sampled_from(["alpha", "beta's", "gamma", "δ", "42", "{x}"]),
                                  min_size=1, max_size=900 if big else 40)))


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    """OpenAI conversations with tool calls, images and long turns, ending on a user turn."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "content": _text(draw, False)})
    calls = 0
    for _ in range(draw(st.integers(1, 14))):
        user: Any = _text(draw, draw(st.booleans()))
        if draw(st.integers(0, 4)) == 0:
            user = [{"type": "text", "text": user}, IMAGE]
        out.append({"role": "user", "content": user})
        if draw(st.booleans()):
            ids = [f"c{calls + k}" for k in range(draw(st.integers(1, 3)))]
            calls += len(ids)
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {**CALL, "id": i, "function": {"name": "lookup", "arguments": f'{{"q": "{i}"}}'}} for i in ids]})
            out += [{"role": "tool", "tool_call_id": i, "content": _text(draw, draw(st.booleans()))} for i in ids]
        out.append({"role": "assistant", "content": _text(draw, draw(st.booleans()))})
    out.append({"role": "user", "content": _text(draw, False)})
    return out


EXAMPLES = int(os.environ.get("IBEX_CHAT_PROPERTY_EXAMPLES", "300"))


@settings(max_examples=examples(EXAMPLES), deadline=None)
@given(conversations(), st.sampled_from(["gpt-4", "gpt-3.5-turbo"]), st.integers(0, 3))
def test_property_no_orphans_latest_turn_kept_exact_count_within_window(
        convo: list[dict[str, Any]], model: str, recent: int) -> None:
    req = _req(convo, model=model, tools=TOOLS, history={"min_recent_turns": recent})
    try:
        resp = _run(req)
    except ContextOverflow:
        event("overflow")
        return  # only when what may not be dropped does not fit (tests/unit/test_history.py checks when)
    event("trimmed" if resp.history else "fits whole")
    out = resp.messages
    assert out is not None and out[-1] == convo[-1]
    parse_conversation("openai", out, tools=TOOLS)  # no orphaned call or result, valid as sent
    exact = cc.openai_prompt_tokens(out, TOOLS, CATALOG.counter("cl100k"), model=model)
    assert resp.prompt_tokens == exact <= _limit(resp)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=12),
       st.sampled_from(["o200k", "cl100k", "llama3", "qwen"]))
def test_memory_block_count_is_the_exact_bpe_count(contents: list[str], family: str) -> None:
    """The block's count from cached line counts equals a fresh BPE pass over the block, for any
    memory text (``pipeline.rendering.openai.memory_block_tokens``: the pre-tokenizers split between lines)."""
    from ibex_context.pipeline import format as fmt
    from ibex_context.pipeline.counting.count import LineCache
    from ibex_context.pipeline.rendering.openai import memory_block_tokens
    from ibex_context.pipeline.types import ScoredMemory

    kept = [ScoredMemory(MemoryHit(f"m{i}", c, "fact", 0.9, 0.9, i + 1, "hot"), 1, 0.9)
            for i, c in enumerate(contents)]
    nonce = fmt.new_nonce()
    counter = CATALOG.counter(family)
    block = fmt.memory_section(kept, nonce)
    assert memory_block_tokens(counter, kept, nonce, LineCache()) == counter.count(block)


@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=12),
       st.sampled_from(["o200k", "cl100k", "llama3", "qwen"]))
def test_scored_block_count_is_the_block_count(contents: list[str], family: str) -> None:
    """Memories priced by the scorer (``MemoryCost`` with the same counter and line cache) give the
    block's exact count from their own ``tokens`` (what the render stage uses)."""
    from ibex_context.pipeline import format as fmt
    from ibex_context.pipeline.counting.count import LineCache, MemoryCost
    from ibex_context.pipeline.rendering.openai import memory_block_tokens, scored_block_tokens
    from ibex_context.pipeline.selection.score import score_candidates

    hits = [MemoryHit(f"m{i}", c, "fact", 0.9, 0.9, i + 1, "hot") for i, c in enumerate(contents)]
    counter, lines = CATALOG.counter(family), LineCache()
    kept, _ = score_candidates(hits, MemoryCost(counter, lines))
    nonce = fmt.new_nonce()
    assert scored_block_tokens(counter, kept, nonce) == memory_block_tokens(counter, kept, nonce, lines)
    assert scored_block_tokens(counter, kept, nonce) == counter.count(fmt.memory_section(kept, nonce))


def test_explain_prints_the_prompt_and_each_dropped_message(tmp_path: Path) -> None:
    import argparse
    import io
    import json

    from ibex_context.ops.explain import run

    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 900} for i in range(20)]
    request = {"request_id": "x", "org_id": "acme", "agent_id": "support-bot", "model": "gpt-4", "query": "q",
               "format": "openai", "messages": [*long, {"role": "user", "content": "the latest question"}]}
    (tmp_path / "req.json").write_text(json.dumps(request))
    examples = Path(__file__).resolve().parents[2] / "examples" / "candidates.json"
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(request=str(tmp_path / "req.json"), candidates=str(examples), nonce=None,
                              format="table")
    assert run(args, out, err) == 0, err.getvalue()
    text = out.getvalue()
    assert "Prompt (openai):" in text and "dropped message    0 user" in text
    request["history"] = {"mode": "fail"}
    (tmp_path / "req.json").write_text(json.dumps(request))
    assert run(args, io.StringIO(), err) == 2 and "CONTEXT_OVERFLOW" in err.getvalue()


@st.composite
def anthropic_conversations(draw: Any) -> list[dict[str, Any]]:
    """Anthropic conversations with tool_use/tool_result rounds, images and long turns."""
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/r.png"}}
    out: list[dict[str, Any]] = []
    uses = 0
    for _ in range(draw(st.integers(1, 12))):
        user: Any = _text(draw, draw(st.booleans()))
        if draw(st.integers(0, 4)) == 0:
            user = [{"type": "text", "text": user}, image]
        out.append({"role": "user", "content": user})
        if draw(st.booleans()):
            ids = [f"tu{uses + k}" for k in range(draw(st.integers(1, 3)))]
            uses += len(ids)
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": i, "name": "lookup", "input": {"q": i}} for i in ids]})
            out.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": i, "content": _text(draw, draw(st.booleans()))} for i in ids]})
        out.append({"role": "assistant", "content": _text(draw, draw(st.booleans()))})
    out.append({"role": "user", "content": _text(draw, False)})
    return out


@settings(max_examples=examples(EXAMPLES), deadline=None)
@given(anthropic_conversations(), st.integers(0, 3))
def test_property_anthropic_no_orphans_latest_turn_kept_within_window(
        convo: list[dict[str, Any]], recent: int) -> None:
    """Anthropic's 200K windows are too large to trim generated turns cheaply, so a catalog with a
    6K-window model of the same (estimated) tokenizer family is used; the count there is an
    estimate, so the check is that the emitted prompt's recount equals the reported one and fits."""
    req = _req(convo, model="claude-small", fmt="anthropic", system="Be kind.",
               tools=[{"name": "lookup", "input_schema": {"type": "object"}}],
               history={"min_recent_turns": recent})
    try:
        resp = assemble(req, offline_result(directive="Answer briefly.", hot=HITS, cold=[]),
                        Engine(SMALL_CLAUDE, Policy()))
    except ContextOverflow:
        event("overflow")
        return
    event("trimmed" if resp.history else "fits whole")
    assert resp.messages is not None and resp.system is not None
    assert [b["text"] for b in resp.system] == ["Be kind.", "Answer briefly."]
    stripped = _without_memory_block(resp.messages, resp.nonce) if resp.packed else resp.messages
    assert _as_blocks(stripped)[-1] == _as_blocks([convo[-1]])[0]
    parse_conversation("anthropic", resp.messages, system=resp.system)  # no orphaned tool_use or result
    recount = cc.anthropic_prompt_tokens(resp.system, resp.messages, [{"name": "lookup", "input_schema": {
        "type": "object"}}], SMALL_CLAUDE.counter(resp.budget.tokenizer_family), model="claude-small")
    assert resp.prompt_tokens == recount <= _limit(resp)


def _small_claude() -> Catalog:
    import json

    from ibex_context.pipeline.budget.catalog import Catalog as _Catalog

    path = Path(__file__).resolve().parents[2] / "pipeline" / "budget" / "catalog.json"
    data = json.loads(path.read_text())
    fam = data["models"]["claude-sonnet-4"]["family"]
    data["models"]["claude-small"] = {"family": fam, "context_window": 6_000, "max_output": 4096}
    return _Catalog(data)


SMALL_CLAUDE = _small_claude()


def test_a_part_refused_at_counting_is_named_by_its_place_in_the_conversation() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [audio]}]
    with pytest.raises(InvalidRequest) as info:
        _run(_req(convo))
    assert info.value.field == "messages.2.content.0" and info.value.message.startswith("messages.2.content.0: ")
