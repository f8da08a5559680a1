"""Clear before drop against drop only on generated tool-heavy conversations, in both provider forms;
the clearing step that keeps the cleared boundary still between calls; and Anthropic thinking that
fits by the provider's rule not trimmed (docs/assembly.md "Context editing").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation import context_edit
from ibex_context.pipeline.conversation.parse import parse_conversation
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.shared.wire.errors import ContextOverflow
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse
from tests.properties import examples

NAMES = ["read_file", "run_command", "search_web"]
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for n in NAMES]
A_TOOLS = [{"name": n, "description": f"{n} tool", "input_schema": {"type": "object"}} for n in NAMES]


def _catalog() -> Catalog:
    """The shipped catalog plus an 8K Claude (the pipeline's Anthropic path on a window generated
    conversations overflow) and claude-sonnet-4 (strips earlier thinking) and opus-4-5 (does not) at 8K."""
    data = json.loads((Path(__file__).resolve().parents[2] / "pipeline" / "budget" / "catalog.json").read_text())
    fam = data["models"]["claude-sonnet-4"]["family"]
    data["models"]["claude-small"] = {"family": fam, "context_window": 8_000, "max_output": 1024}
    data["models"]["claude-sonnet-4"] = {"family": fam, "context_window": 8_000, "max_output": 1024}
    data["models"]["claude-opus-4-5"] = {"family": fam, "context_window": 8_000, "max_output": 1024}
    return Catalog(data)


CATALOG = _catalog()


def _run(messages: list[Any], *, model: str, fmt: str, editing: dict[str, Any]) -> AssembleResponse:
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model=model, query="q", format=fmt,
                          messages=messages, tools=TOOLS if fmt == "openai" else A_TOOLS, deadline_ns=1,
                          history={"context_editing": editing})  # type: ignore[arg-type]
    return assemble(req, offline_result(directive="Be brief.", hot=[], cold=[]), Engine(CATALOG, Policy()))


def _limit(resp: AssembleResponse) -> int:
    return resp.budget.context_window - resp.budget.response_reserve


# --------------------------------------------------------------------------- generated agents

WORD = st.sampled_from(["line", "test", "def"])  # one strategy for every word: built and checked once


def _bulk(draw: Any) -> str:
    """A tool output of 0.2 to 4 KB (the 2-50 KB of the bench, scaled to an 8K window)."""
    n = draw(st.integers(30, 600))
    return " ".join(f"{draw(WORD)}{i}" for i in range(n))


@st.composite
def agent(draw: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """An OpenAI-shaped coding agent: labelled facts in the first user turns, tool loops of large
    outputs, short answers, a late question; sometimes an open tool loop at the end. Returns the
    messages and the facts as stated."""
    turns = draw(st.integers(2, 10))
    facts = [f"[F{k}] the value of setting {k} is {draw(st.integers(100, 999))}."
             for k in range(draw(st.integers(1, 3)))]
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    calls = 0
    for t in range(turns):
        fact = f" Keep in mind: {facts[t]}" if t < len(facts) else ""
        out.append({"role": "user", "content": f"step {t}: fix the failing test.{fact}"})
        for _ in range(draw(st.integers(0, 3))):
            ids = [f"c{calls + k}" for k in range(draw(st.integers(1, 2)))]
            calls += len(ids)
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": draw(st.sampled_from(NAMES)),
                                                           "arguments": json.dumps({"q": f"step {t}"})}}
                for i in ids]})
            out += [{"role": "tool", "tool_call_id": i, "content": _bulk(draw)} for i in ids]
        out.append({"role": "assistant", "content": f"done with step {t}: the cause was a stale fixture."})
    out.append({"role": "user", "content": "what did I tell you in " + ", ".join(f"[F{k}]" for k in range(len(facts)))})
    if draw(st.booleans()):
        out += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "now", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "now", "content": _bulk(draw)}]
    return out, facts


def to_anthropic(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation in Anthropic's shape (system left out: it goes in ``system``)."""
    out: list[dict[str, Any]] = []
    for m in msgs:
        if m["role"] == "system":
            continue
        if m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)  # results of one call message share one user turn
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _words(messages: list[dict[str, Any]]) -> int:
    """User and assistant messages with words of their own (not tool calls or results)."""
    n = 0
    for m in messages:
        c = m.get("content")
        if m.get("role") in ("user", "assistant") and (
                (isinstance(c, str) and c) or (isinstance(c, list) and any(b.get("type") == "text" for b in c))):
            n += 1
    return n


def _facts(messages: list[dict[str, Any]], facts: list[str]) -> set[str]:
    texts = [m["content"] if isinstance(m["content"], str) else
             " ".join(b.get("text", "") for b in m["content"] if b.get("type") == "text")
             for m in messages if m.get("role") == "user" and m.get("content")]
    return {f for f in facts if any(f in t for t in texts)}


def _groups_valid(fmt: str, out: list[dict[str, Any]]) -> None:
    """Every tool call has its result and every result its call (the parser refuses otherwise; the
    two id lists are also compared)."""
    parse_conversation(fmt, out, tools=TOOLS if fmt == "openai" else A_TOOLS)  # type: ignore[arg-type]
    if fmt == "openai":
        calls = [c["id"] for m in out for c in m.get("tool_calls") or ()]
        results = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    else:
        blocks = [(m["role"], b) for m in out if isinstance(m["content"], list) for b in m["content"]]
        calls = [b["id"] for r, b in blocks if b.get("type") == "tool_use"]
        results = [b["tool_use_id"] for r, b in blocks if b.get("type") == "tool_result"]
    assert sorted(calls) == sorted(results)
    assert [u.id for u in context_edit.tool_uses(fmt, out)] == calls  # type: ignore[arg-type]


def _recount(fmt: str, resp: AssembleResponse, model: str) -> int:
    counter = CATALOG.counter(resp.budget.tokenizer_family)
    assert resp.messages is not None
    if fmt == "openai":
        return cc.openai_prompt_tokens(resp.messages, TOOLS, counter, model=model)
    return cc.anthropic_prompt_tokens(resp.system, resp.messages, A_TOOLS, counter, model=model)


EDITING = st.fixed_dictionaries({"keep": st.integers(0, 4), "clear_at_least": st.sampled_from([0, 100, 1024]),
                                 "step_share": st.sampled_from([0.0, 0.25, 0.5])})


@settings(max_examples=examples(80), deadline=None)
@given(agent(), st.sampled_from(["openai", "anthropic"]), EDITING)
def test_property_clear_then_drop_keeps_what_drop_only_keeps(
        case: tuple[list[dict[str, Any]], list[str]], fmt: str, editing: dict[str, Any]) -> None:
    convo, facts = case
    msgs = convo if fmt == "openai" else to_anthropic(convo)
    model = "gpt-4" if fmt == "openai" else "claude-small"
    got: dict[bool, AssembleResponse | None] = {}
    for enabled in (False, True):
        try:
            got[enabled] = _run(msgs, model=model, fmt=fmt, editing={**editing, "enabled": enabled})
        except ContextOverflow:
            got[enabled] = None
    drop, clear = got[False], got[True]
    if clear is None:  # clearing never turns a conversation that fits into one that does not
        assert drop is None
        event("both overflow")
        return
    for resp in (r for r in (drop, clear) if r is not None):
        assert resp.messages is not None and resp.prompt_tokens is not None
        assert resp.prompt_tokens == _recount(fmt, resp, model) <= _limit(resp)  # never over the window
        _groups_valid(fmt, resp.messages)
    assert clear.messages is not None
    if drop is None:
        event("only clear-then-drop fits")
        return
    assert drop.messages is not None
    assert _words(clear.messages) >= _words(drop.messages)
    assert _facts(clear.messages, facts) >= _facts(drop.messages, facts)
    event("clear kept more" if _words(clear.messages) > _words(drop.messages) else "same words")


# --------------------------------------------------------------------------- the clearing step

def _growing(turns: int) -> list[list[dict[str, Any]]]:
    """Every model call of a coding agent, as the prefix it sends: after each user message and
    after each tool result (two calls of ~1,200 tokens each per turn)."""
    convo: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    calls = []
    for t in range(turns):
        convo.append({"role": "user", "content": f"step {t}: fix it"})
        calls.append(list(convo))
        for k in range(2):
            cid = f"c{t}_{k}"
            convo.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": NAMES[k], "arguments": "{}"}}]})
            result = " ".join(f"l{t}.{k}.{w}" for w in range(500))
            convo.append({"role": "tool", "tool_call_id": cid, "content": result})
            calls.append(list(convo))
        convo.append({"role": "assistant", "content": f"step {t} fixed"})
    return calls


def _boundary_moves(step_share: float) -> tuple[int, int]:
    """(calls where an already-sent message was sent changed, calls over the window) on gpt-4o-mini
    with ``trigger_tokens`` 20,000: the cleared boundary moving breaks the cached prefix there."""
    moves = over = 0
    prev: list[dict[str, Any]] | None = None
    for msgs in _growing(40):
        resp = _run(msgs, model="gpt-4o-mini", fmt="openai",
                    editing={"trigger_tokens": 20_000, "step_share": step_share, "clear_at_least": 1024})
        assert resp.messages is not None and resp.prompt_tokens is not None
        assert not resp.history  # clearing alone keeps it under the trigger: nothing dropped
        over += resp.prompt_tokens > 20_000
        if prev is not None and resp.messages[:len(prev)] != prev:
            moves += 1
        prev = resp.messages
    return moves, over


def test_step_share_keeps_the_cleared_boundary_still_for_several_calls() -> None:
    """With steps of half the limit the cleared set changes on few calls; with steps of
    clear_at_least alone it changes on nearly every call once the trigger is passed."""
    fine, over_fine = _boundary_moves(0.0)
    coarse, over_coarse = _boundary_moves(0.5)
    assert over_fine == over_coarse == 0
    assert coarse * 2 <= fine
    assert coarse >= 1


def test_step_is_clear_at_least_or_the_share_of_the_limit() -> None:
    policy = context_edit.ClearPolicy(clear_at_least=1024, step_share=0.5)
    assert policy.step(10_000) == 5_000 and policy.step(1_000) == 1024
    assert context_edit.ClearPolicy(clear_at_least=0, step_share=0.0).step(10_000) == 0


# --------------------------------------------------------------------------- thinking as Anthropic counts it

def _thinking_convo(turns: int) -> list[dict[str, Any]]:
    """Turns whose assistant replies carry long thinking (~1,100 tokens each), then a tool loop."""
    out: list[dict[str, Any]] = []
    for t in range(turns):
        out.append({"role": "user", "content": f"question {t}?"})
        out.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"reasoning about {t} " * 300, "signature": f"s{t}"},
            {"type": "text", "text": f"answer {t}."}]})
    out.append({"role": "user", "content": "and now?"})
    out.append({"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I will look it up. " * 40, "signature": "loop"},
        {"type": "tool_use", "id": "tu", "name": "search_web", "input": {"q": "now"}}]})
    out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu", "content": "found"}]})
    return out


def test_thinking_that_fits_by_the_providers_rule_is_not_trimmed() -> None:
    convo = _thinking_convo(8)
    counter = CATALOG.counter("claude")
    earlier = sum(cc.anthropic_thinking_tokens(m, counter) for m in convo[:16])
    ruled = cc.anthropic_prompt_tokens(None, convo, A_TOOLS, counter, model="claude-sonnet-4")
    bare = cc.anthropic_prompt_tokens(None, convo, [], counter, model=None)  # every block counted
    assert cc.anthropic_prompt_tokens(None, convo, [], counter, model="claude-sonnet-4") == bare - earlier
    full = ruled + earlier  # earlier turns' thinking counts zero, the loop's in full
    assert cc.anthropic_thinking_tokens(convo[17], counter) > 0
    resp = _run(convo, model="claude-sonnet-4", fmt="anthropic", editing={})
    assert full > _limit(resp) >= ruled  # counted in full it would not fit; by the rule it does
    assert not resp.history and resp.messages == convo  # nothing trimmed, every block sent as given
    assert resp.prompt_tokens == cc.anthropic_prompt_tokens(resp.system, resp.messages, A_TOOLS, counter,
                                                            model="claude-sonnet-4") <= _limit(resp)
    assert {e.action for e in resp.edits if e.index < 16} == {"thinking_free"}
    # a model that keeps earlier thinking in its window counts it, so the same conversation is trimmed
    kept = _run(convo, model="claude-opus-4-5", fmt="anthropic", editing={})
    assert kept.history and kept.prompt_tokens is not None and kept.prompt_tokens <= _limit(kept)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.booleans(), st.booleans()), min_size=1, max_size=8),
       st.booleans())
def test_property_thinking_counts_as_the_documented_rule(turns: list[tuple[int, bool, bool]], loop: bool) -> None:
    """``context_window = (input_tokens - previous_thinking_tokens) + current_turn_tokens`` on a
    stripping model; every thinking block counted on one that keeps them."""
    counter = CATALOG.counter("claude")
    convo: list[dict[str, Any]] = []
    for t, (words, redacted, text) in enumerate(turns):
        kind = ({"type": "redacted_thinking", "data": "QUJD" * words} if redacted else
                {"type": "thinking", "thinking": "hmm " * words, "signature": "s"})
        convo += [{"role": "user", "content": f"q{t}"},
                  {"role": "assistant", "content": [kind, {"type": "text", "text": "a" if text else "b"}]}]
    if loop:
        convo += [{"role": "user", "content": "now?"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "look " * 50, "signature": "l"},
                                                    {"type": "tool_use", "id": "x", "name": "read_file", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "ok"}]}]
    else:
        convo.append({"role": "user", "content": "thanks"})
    latest = cc.latest_turn(convo)
    assert latest is not None
    previous = sum(cc.anthropic_thinking_tokens(m, counter) for m in convo[:latest])
    full = cc.anthropic_prompt_tokens(None, convo, [], counter, model="claude-opus-4-5")
    assert cc.anthropic_prompt_tokens(None, convo, [], counter, model="claude-sonnet-4") == full - previous
