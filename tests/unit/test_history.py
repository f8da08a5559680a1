"""History trimming (pipeline/conversation/history.py) and provider-ready rendering (pipeline/rendering/chat_render.py).

Hand cases pin the documented behaviour; the property tests generate OpenAI and Anthropic
conversations with tool calls, images and long histories and check the invariants against an
oracle written independently of the implementation (which messages are pinned is recomputed here
from the message shapes, not from ``split_units``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.conversation.history import (
    HistoryOverflow,
    HistoryPolicy,
    fit_history,
    history_budget,
    latest_user_index,
    split_units,
)
from ibex_context.pipeline.rendering.chat_render import render_anthropic, render_openai
from ibex_context.shared.wire.errors import InvalidRequest
from tests.properties import examples

Msg = dict[str, Any]


def cost(message: Msg) -> int:
    """Stand-in for provider-faithful counting: any deterministic non-negative cost will do."""
    return len(json.dumps(message, sort_keys=True)) // 4 + 3


def total(messages: list[Msg]) -> int:
    return sum(cost(m) for m in messages)


# ---- builders --------------------------------------------------------------------------------

def o_sys(text: str = "You are terse.") -> Msg:
    return {"role": "system", "content": text}


def o_user(text: str) -> Msg:
    return {"role": "user", "content": text}


def o_image_user(text: str, url: str = "https://example.com/cat.png") -> Msg:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}


def o_asst(text: str) -> Msg:
    return {"role": "assistant", "content": text}


def o_calls(*ids: str) -> Msg:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": i})}}
        for i in ids]}


def o_tool(call_id: str, text: str) -> Msg:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def a_user(text: str) -> Msg:
    return {"role": "user", "content": text}


def a_asst(text: str) -> Msg:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def a_uses(*ids: str) -> Msg:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "lookup", "input": {"q": i}}
                                             for i in ids]}


def a_results(*ids: str, text: str | None = None) -> Msg:
    blocks: list[Msg] = [{"type": "tool_result", "tool_use_id": i, "content": f"result {i}"} for i in ids]
    if text is not None:
        blocks.append({"type": "text", "text": text})
    return {"role": "user", "content": blocks}


# ---- hand cases: units and trimming ----------------------------------------------------------

def test_units_group_openai_tool_calls_with_their_results() -> None:
    msgs = [o_sys(), o_user("hi"), o_calls("a", "b"), o_tool("a", "1"), o_tool("b", "2"), o_asst("ok"), o_user("q")]
    units = split_units("openai", msgs)
    assert [(u.start, u.stop, u.kind) for u in units] == [
        (0, 1, "system"), (1, 2, "message"), (2, 5, "tool_exchange"), (5, 6, "message"), (6, 7, "message")]


def test_units_group_anthropic_tool_use_with_the_next_user_message() -> None:
    msgs = [a_user("hi"), a_uses("t1"), a_results("t1", text="and also"), a_asst("done"), a_user("q")]
    units = split_units("anthropic", msgs)
    assert [(u.start, u.stop, u.kind) for u in units] == [
        (0, 1, "message"), (1, 3, "tool_exchange"), (3, 4, "message"), (4, 5, "message")]


def test_a_tool_call_unit_is_dropped_whole_with_a_decision_per_message() -> None:
    msgs = [o_sys(), o_user("old question " * 5), o_calls("a", "b"), o_tool("a", "x" * 200),
            o_tool("b", "y" * 200), o_asst("answer " * 10), o_user("latest question")]
    # Budget: everything except the user message at 1 and the tool exchange fits; dropping
    # message 1 alone is not enough, so the whole exchange 2..4 goes, then the orphaned reply 5.
    budget = total(msgs) - cost(msgs[1]) - 1
    fit = fit_history("openai", msgs, cost=cost, budget=budget, policy=HistoryPolicy())
    assert fit.kept_indices == (0, 6)
    assert [(d.index, d.role, d.reason, d.unit) for d in fit.dropped] == [
        (1, "user", "trim_oldest", 1), (2, "assistant", "trim_oldest", 2), (3, "tool", "trim_oldest", 2),
        (4, "tool", "trim_oldest", 2), (5, "assistant", "start_on_user", 3)]
    assert [d.tokens for d in fit.dropped] == [cost(msgs[i]) for i in range(1, 6)]
    assert fit.kept_tokens == cost(msgs[0]) + cost(msgs[6]) <= budget
    assert fit.dropped_tokens == total(msgs) - fit.kept_tokens
    assert fit.kept[0] is msgs[0] and fit.kept[1] is msgs[6]


def test_without_start_on_user_the_reply_whose_question_went_stays() -> None:
    msgs = [o_user("q1 " * 30), o_asst("a1"), o_user("q2")]
    budget = total(msgs) - 1
    fit = fit_history("openai", msgs, cost=cost, budget=budget, policy=HistoryPolicy(start_on_user=False))
    assert fit.kept_indices == (1, 2)
    fit = fit_history("openai", msgs, cost=cost, budget=budget)
    assert fit.kept_indices == (2,)


def test_nothing_is_dropped_when_it_fits() -> None:
    msgs = [o_sys(), o_user("a"), o_asst("b"), o_user("c")]
    fit = fit_history("openai", msgs, cost=cost, budget=total(msgs))
    assert fit.kept_indices == (0, 1, 2, 3) and not fit.trimmed and fit.kept_tokens == total(msgs)


def test_the_latest_user_turn_alone_over_budget_is_an_overflow() -> None:
    msgs = [o_sys(), o_user("old"), o_asst("reply"), o_user("huge " * 400)]
    pinned = cost(msgs[0]) + cost(msgs[3])
    with pytest.raises(HistoryOverflow) as info:
        fit_history("openai", msgs, cost=cost, budget=pinned - 7)
    err = info.value
    assert (err.needed, err.available, err.over_by, err.reason) == (pinned, pinned - 7, 7, "pinned")
    assert "7 over" in str(err)
    assert fit_history("openai", msgs, cost=cost, budget=pinned).kept_indices == (0, 3)


def test_the_current_agent_turn_is_pinned_with_the_latest_user_message() -> None:
    msgs = [o_user("old " * 50), o_asst("r"), o_user("now"), o_calls("a"), o_tool("a", "r" * 300),
            o_calls("b"), o_tool("b", "s" * 300)]
    fit = fit_history("openai", msgs, cost=cost, budget=total(msgs[2:]))
    assert fit.kept_indices == (2, 3, 4, 5, 6)
    with pytest.raises(HistoryOverflow):
        fit_history("openai", msgs, cost=cost, budget=total(msgs[2:]) - 1)


def test_fail_mode_refuses_to_drop_anything() -> None:
    msgs = [o_sys(), o_user("old " * 40), o_asst("r"), o_user("now")]
    policy = HistoryPolicy(mode="fail")
    with pytest.raises(HistoryOverflow) as info:
        fit_history("openai", msgs, cost=cost, budget=total(msgs) - 3, policy=policy)
    assert (info.value.needed, info.value.over_by, info.value.reason) == (total(msgs), 3, "fail_mode")
    fit = fit_history("openai", msgs, cost=cost, budget=total(msgs), policy=policy)
    assert fit.kept_indices == (0, 1, 2, 3)


def test_min_recent_turns_pins_earlier_user_turns() -> None:
    msgs = [o_user("first " * 20), o_asst("r1 " * 20), o_user("second " * 20), o_asst("r2 " * 20), o_user("third")]
    budget = total(msgs[2:])
    assert fit_history("openai", msgs, cost=cost, budget=budget).kept_indices == (2, 3, 4)
    assert fit_history("openai", msgs, cost=cost, budget=budget - 1).kept_indices == (4,)
    two = HistoryPolicy(min_recent_turns=2)
    assert fit_history("openai", msgs, cost=cost, budget=budget, policy=two).kept_indices == (2, 3, 4)
    with pytest.raises(HistoryOverflow) as info:
        fit_history("openai", msgs, cost=cost, budget=budget - 1, policy=two)
    assert info.value.over_by == 1
    # More turns asked for than exist: every user turn is pinned, nothing before the first one.
    many = HistoryPolicy(min_recent_turns=9)
    assert fit_history("openai", [o_asst("hello"), *msgs], cost=cost, budget=total(msgs),
                       policy=many).kept_indices == (1, 2, 3, 4, 5)


def test_anthropic_tool_units_and_a_latest_turn_that_carries_tool_results() -> None:
    msgs = [a_user("old " * 30), a_uses("t1"), a_results("t1"), a_asst("done " * 10), a_user("next"),
            a_uses("t2"), a_results("t2", text="and here is my new question")]
    # The last user turn is message 6 (tool results plus text): its tool_use (5) is pinned with it.
    pinned = total(msgs[5:])
    fit = fit_history("anthropic", msgs, cost=cost, budget=pinned)
    assert fit.kept_indices == (5, 6)
    assert {d.unit for d in fit.dropped if d.index in (1, 2)} == {1}
    with pytest.raises(HistoryOverflow):
        fit_history("anthropic", msgs, cost=cost, budget=pinned - 1)
    # Room for more: the oldest user message goes first, then the exchange 1..2 as one unit,
    # and the reply at 3 (its question gone) with it; "next" (4) is a user turn and stays.
    fit = fit_history("anthropic", msgs, cost=cost, budget=total(msgs) - cost(msgs[0]) - 1)
    assert fit.kept_indices == (4, 5, 6)
    assert [d.reason for d in fit.dropped] == ["trim_oldest", "trim_oldest", "trim_oldest", "start_on_user"]


def test_anthropic_tool_results_only_message_is_not_a_user_turn() -> None:
    msgs = [a_user("question " * 20), a_uses("t1"), a_results("t1")]
    fit = fit_history("anthropic", msgs, cost=cost, budget=total(msgs))
    assert fit.kept_indices == (0, 1, 2)
    with pytest.raises(HistoryOverflow):  # the question is the latest user turn: pinned
        fit_history("anthropic", msgs, cost=cost, budget=total(msgs) - 1)


def test_without_any_user_turn_the_last_unit_is_pinned() -> None:
    msgs = [o_sys(), o_asst("one " * 30), o_calls("a"), o_tool("a", "x")]
    fit = fit_history("openai", msgs, cost=cost, budget=total([msgs[0], *msgs[2:]]))
    assert fit.kept_indices == (0, 2, 3)
    assert fit_history("openai", [], cost=cost, budget=0).kept == ()


def test_bad_policy_format_and_cost_are_refused_with_their_path() -> None:
    with pytest.raises(InvalidRequest) as info:
        HistoryPolicy(mode="drop_all")  # type: ignore[arg-type]
    assert info.value.field == "history.mode"
    with pytest.raises(InvalidRequest) as info:
        HistoryPolicy(min_recent_turns=-1)
    assert info.value.field == "history.min_recent_turns"
    with pytest.raises(InvalidRequest) as info:
        fit_history("gemini", [], cost=cost, budget=10)  # type: ignore[arg-type]
    assert info.value.field == "format"
    with pytest.raises(ValueError, match=r"messages\.1: the cost function returned -1"):
        fit_history("openai", [o_user("a"), o_user("b")], cost=lambda m: 1 if m["content"] == "a" else -1, budget=9)


def test_history_budget_keeps_the_memory_share_out() -> None:
    assert history_budget(1000, HistoryPolicy()) == 1000
    assert history_budget(1000, HistoryPolicy(min_memory_share=0.25)) == 750
    assert history_budget(999, HistoryPolicy(min_memory_share=0.5)) == 499  # rounded for the memories
    assert history_budget(-5, HistoryPolicy()) == 0
    for bad in (1.0, -0.1, True, "0.2"):
        with pytest.raises(InvalidRequest) as info:
            HistoryPolicy(min_memory_share=bad)  # type: ignore[arg-type]
        assert info.value.field == "history.min_memory_share"


# ---- hand cases: rendering -------------------------------------------------------------------

def test_render_openai_places_directive_after_leading_system_and_memory_before_latest_user() -> None:
    kept = [o_sys("caller"), o_user("q1"), o_asst("a1"), o_image_user("look"), o_calls("c"), o_tool("c", "r")]
    out = render_openai(kept, directive="DIRECTIVE", memory_block="MEMORY", system_role="system")
    assert out == [kept[0], {"role": "system", "content": "DIRECTIVE"}, kept[1], kept[2],
                   {"role": "system", "content": "MEMORY"}, kept[3], kept[4], kept[5]]
    assert [m is k for m, k in zip([out[0], *out[2:4], *out[5:]], kept, strict=True)] == [True] * 6
    dev = render_openai([o_user("q")], directive="D", memory_block="M", system_role="developer")
    assert dev == [{"role": "developer", "content": "D"}, {"role": "developer", "content": "M"}, o_user("q")]
    assert render_openai(kept, directive=None, memory_block="", system_role="system") == kept
    assert render_openai([o_asst("x")], directive=None, memory_block="M")[-1] == {"role": "system", "content": "M"}
    with pytest.raises(InvalidRequest):
        render_openai(kept, directive="D", memory_block=None, system_role="user")  # type: ignore[arg-type]


def test_render_anthropic_system_blocks_caller_then_directive_memory_in_latest_user_turn() -> None:
    kept = [a_user("q"), a_uses("t"), a_results("t")]
    cached = {"type": "text", "text": "caller", "cache_control": {"type": "ephemeral"}}
    system, messages = render_anthropic([cached], kept, directive="D", memory_block="M")
    assert system == [cached, {"type": "text", "text": "D"}]
    # a_results("t") holds only tool results, so the latest user turn is the first message
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "M"}, {"type": "text", "text": "q"}]},
                        kept[1], kept[2]]
    assert system[0] is cached and messages[1] is kept[1] and messages[2] is kept[2] and kept[0] == a_user("q")
    _, messages = render_anthropic("caller", [*kept, a_results("u", text="more")], directive=None, memory_block="M")
    assert messages[-1]["content"] == [{"type": "tool_result", "tool_use_id": "u", "content": "result u"},
                                       {"type": "text", "text": "M"}, {"type": "text", "text": "more"}]
    system, messages = render_anthropic("caller", [a_uses("t")], directive=None, memory_block="M")
    assert system == [{"type": "text", "text": "caller"}, {"type": "text", "text": "M"}]  # no user turn
    assert render_anthropic(None, kept, directive="", memory_block=None)[0] == []
    assert render_anthropic("", [], directive="D", memory_block=None)[0] == [{"type": "text", "text": "D"}]


def test_rendering_is_deterministic_bytes() -> None:
    kept = [o_sys(), o_image_user("q"), o_calls("a"), o_tool("a", "r")]
    one = json.dumps(render_openai(kept, directive="D", memory_block="M"), sort_keys=True)
    two = json.dumps(render_openai(json.loads(json.dumps(kept)), directive="D", memory_block="M"), sort_keys=True)
    assert one == two
    a1 = json.dumps(render_anthropic("s", kept[1:2], directive="D", memory_block="M"), sort_keys=True)
    a2 = json.dumps(render_anthropic("s", kept[1:2], directive="D", memory_block="M"), sort_keys=True)
    assert a1 == a2


# ---- property tests over generated conversations ---------------------------------------------

# One step of a conversation: a kind, a text, a number of tool calls, a variant flag. Steps become
# messages below, with unique tool ids; 50 steps make up to ~200 messages (long histories).
# A step (kind, text of 0-300 words, 1-3 tool calls, a flag) is one draw from every combination:
# a tuple of four strategies cost hypothesis five draws a step, most of these tests' time.
_TEXTS = ["w " * n for n in range(301)]
STEP = st.sampled_from([(kind, text, calls, flag)
                        for kind in ["user", "image", "assistant", "tools", "tools", "system"]
                        for text in _TEXTS for calls in (1, 2, 3) for flag in (False, True)])
STEPS = st.one_of(st.lists(STEP, max_size=12), st.lists(STEP, min_size=30, max_size=50))


def openai_conversation(steps: list[tuple[str, str, int, bool]]) -> list[Msg]:
    out: list[Msg] = []
    for n, (kind, text, calls, flag) in enumerate(steps):
        if kind == "system":
            out.append({"role": "developer" if flag else "system", "content": text})
        elif kind == "user":
            out.append(o_user(text))
        elif kind == "image":
            out.append(o_image_user(text, url=f"https://img.example/{n}.png"))
        elif kind == "assistant":
            out.append(o_asst(text))
        else:
            ids = [f"call_{n}_{k}" for k in range(calls)]
            out.append(o_calls(*ids))
            out.extend(o_tool(i, text) for i in ids)
    return out


def anthropic_conversation(steps: list[tuple[str, str, int, bool]]) -> list[Msg]:
    out: list[Msg] = []
    for n, (kind, text, calls, flag) in enumerate(steps):
        if kind in ("user", "system"):  # Anthropic's system is a separate field, not a message
            out.append(a_user(text) if flag else {"role": "user", "content": [{"type": "text", "text": text}]})
        elif kind == "image":
            out.append({"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": f"https://img.example/{n}.png"}},
                {"type": "text", "text": text}]})
        elif kind == "assistant":
            thinking: list[Msg] = [{"type": "thinking", "thinking": "hmm", "signature": "sig"}] if flag else []
            out.append({"role": "assistant", "content": [*thinking, {"type": "text", "text": text}]})
        else:
            ids = [f"toolu_{n}_{k}" for k in range(calls)]
            out.append(a_uses(*ids))
            out.append(a_results(*ids, text=text if flag else None))
    return out


def oracle_user_turn(fmt: str, m: Msg) -> bool:
    if m["role"] != "user":
        return False
    return fmt == "openai" or isinstance(m["content"], str) or any(b["type"] != "tool_result" for b in m["content"])


def oracle_pinned(fmt: str, msgs: list[Msg], n_turns: int) -> set[int]:
    """System messages, plus everything from the max(1, N)-th last user turn (moved back to the
    tool call when that turn sits in a tool exchange); with no user turn, the last exchange."""
    if not msgs:
        return set()
    turns = [i for i, m in enumerate(msgs) if oracle_user_turn(fmt, m)]
    start = turns[-min(max(1, n_turns), len(turns))] if turns else len(msgs) - 1
    if fmt == "openai":
        while msgs[start]["role"] == "tool":
            start -= 1
    elif msgs[start]["role"] == "user" and isinstance(msgs[start]["content"], list) \
            and any(b["type"] == "tool_result" for b in msgs[start]["content"]):
        start -= 1
    return {i for i, m in enumerate(msgs) if m["role"] in ("system", "developer")} | set(range(start, len(msgs)))


def openai_orphans(msgs: list[Msg]) -> list[str]:
    """Every tool_calls message directly followed by exactly its results; no other tool message."""
    problems, i = [], 0
    while i < len(msgs):
        if msgs[i]["role"] == "tool":
            problems.append(f"{i}: tool result without its call")
        elif msgs[i].get("tool_calls"):
            j = i + 1
            while j < len(msgs) and msgs[j]["role"] == "tool":
                j += 1
            if sorted(m["tool_call_id"] for m in msgs[i + 1:j]) != sorted(c["id"] for c in msgs[i]["tool_calls"]):
                problems.append(f"{i}: tool calls and results do not match")
            i = j
            continue
        i += 1
    return problems


def _ids(m: Msg | None, block: str, key: str) -> list[str]:
    if m is None or not isinstance(m["content"], list):
        return []
    return sorted(b[key] for b in m["content"] if b["type"] == block)


def anthropic_orphans(msgs: list[Msg]) -> list[str]:
    """Every tool_use answered in the next message; every tool_result asked in the previous one."""
    problems = []
    for i, m in enumerate(msgs):
        nxt, prev = (msgs[i + 1] if i + 1 < len(msgs) else None), (msgs[i - 1] if i else None)
        uses, results = _ids(m, "tool_use", "id"), _ids(m, "tool_result", "tool_use_id")
        if uses and uses != _ids(nxt, "tool_result", "tool_use_id"):
            problems.append(f"{i}: tool_use without its result")
        if results and results != _ids(prev, "tool_use", "id"):
            problems.append(f"{i}: tool_result without its call")
    return problems


@st.composite
def cases(draw: st.DrawFn, fmt: str) -> tuple[list[Msg], int, HistoryPolicy]:
    steps = draw(STEPS)
    msgs = openai_conversation(steps) if fmt == "openai" else anthropic_conversation(steps)
    policy = HistoryPolicy(mode=draw(st.sampled_from(["trim_oldest", "trim_oldest", "fail"])),
                           min_recent_turns=draw(st.integers(0, 3)), start_on_user=draw(st.booleans()))
    pinned = sum(cost(msgs[i]) for i in oracle_pinned(fmt, msgs, policy.min_recent_turns))
    tot = total(msgs)
    # Half the budgets land between the pinned part and the whole, where trimming happens.
    budget = draw(st.one_of(st.integers(0, tot + 20), st.integers(min(pinned, tot), tot)))
    return msgs, budget, policy


def check_fit(fmt: str, msgs: list[Msg], budget: int, policy: HistoryPolicy) -> list[Msg]:
    """The invariants of one fit; returns the kept messages (none when it overflowed)."""
    pinned = oracle_pinned(fmt, msgs, policy.min_recent_turns)
    pinned_cost, tot = sum(cost(msgs[i]) for i in pinned), total(msgs)
    expect_error = pinned_cost > budget or (policy.mode == "fail" and tot > budget)
    try:
        fit = fit_history(fmt, msgs, cost=cost, budget=budget, policy=policy)  # type: ignore[arg-type]
    except HistoryOverflow as err:
        assert expect_error, f"overflow raised though pinned {pinned_cost} <= budget {budget}"
        assert err.needed == (pinned_cost if pinned_cost > budget else tot)
        assert err.available == budget and err.over_by == err.needed - budget > 0
        event(f"overflow ({err.reason})")
        return []
    assert not expect_error
    kept = list(fit.kept_indices)
    assert kept == sorted(set(kept)), "kept messages out of original order"
    assert all(k is msgs[i] for k, i in zip(fit.kept, kept, strict=True))
    assert pinned <= set(kept), "a pinned message (system, latest user turn, its agent turn) was dropped"
    turns = [i for i, m in enumerate(msgs) if oracle_user_turn(fmt, m)]
    assert not turns or turns[-1] in kept
    assert fit.kept_tokens == sum(cost(msgs[i]) for i in kept) <= budget
    dropped = [d.index for d in fit.dropped]
    assert sorted(dropped + kept) == list(range(len(msgs)))
    assert all(d.tokens == cost(msgs[d.index]) and d.role == msgs[d.index]["role"] for d in fit.dropped)
    orphans = openai_orphans if fmt == "openai" else anthropic_orphans
    assert orphans([msgs[i] for i in kept]) == [], "orphaned tool call or result in the output"
    # Oldest first: what went is a prefix of the unpinned messages, and nothing went if all fit.
    unpinned = [i for i in range(len(msgs)) if i not in pinned]
    assert set(dropped) == set(unpinned[:len(dropped)])
    assert tot > budget or not dropped
    check_minimal(fmt, msgs, fit, budget, policy, pinned)
    event("trimmed" if dropped else "fits whole")
    return list(fit.kept)


def check_minimal(fmt: str, msgs: list[Msg], fit: Any, budget: int, policy: HistoryPolicy, pinned: set[int]) -> None:
    """The trim stopped as soon as it fitted; start_on_user drops only leading assistant turns."""
    trimmed = [d for d in fit.dropped if d.reason == "trim_oldest"]
    extra = [d for d in fit.dropped if d.reason == "start_on_user"]
    if trimmed:
        last = sum(d.tokens for d in trimmed if d.unit == trimmed[-1].unit)
        assert fit.kept_tokens + sum(d.tokens for d in extra) + last > budget, "trimmed more than needed"
    assert policy.start_on_user or not extra
    assert all(not oracle_user_turn(fmt, msgs[d.index]) or msgs[d.index - 1]["role"] == "assistant" for d in extra)
    if fit.dropped and policy.start_on_user:
        first = next((i for i in fit.kept_indices if msgs[i]["role"] not in ("system", "developer")), None)
        assert first is None or first in pinned or oracle_user_turn(fmt, msgs[first])


def check_render(fmt: str, kept: list[Msg]) -> None:
    if fmt == "openai":
        out = render_openai(kept, directive="D", memory_block="M", system_role="developer")
        added = [i for i, m in enumerate(out) if not any(m is k for k in kept)]
        assert [out[i]["content"] for i in added] == ["D", "M"]
        assert all(a is b for a, b in zip([m for i, m in enumerate(out) if i not in added], kept, strict=True))
        lead = next((i for i, m in enumerate(kept) if m["role"] not in ("system", "developer")), len(kept))
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        assert added[0] == lead
        assert added[1] + 1 == (users[-1] if users else len(out))
    else:
        system, messages = render_anthropic("S", kept, directive="D", memory_block="M")
        latest = latest_user_index("anthropic", kept)
        assert [b["text"] for b in system] == (["S", "D", "M"] if latest is None else ["S", "D"])
        assert len(messages) == len(kept)
        assert all(a is b for i, (a, b) in enumerate(zip(messages, kept, strict=True)) if i != latest)
        if latest is not None:
            blocks = messages[latest]["content"]
            at = blocks.index({"type": "text", "text": "M"})
            assert all(b["type"] == "tool_result" for b in blocks[:at]) and blocks[at + 1:] != []
            content = kept[latest]["content"]
            assert blocks[:at] + blocks[at + 1:] == ([{"type": "text", "text": content}]
                                                     if isinstance(content, str) else content)


@settings(max_examples=examples(2000))
@given(cases("openai"))
def test_openai_history_invariants(case: tuple[list[Msg], int, HistoryPolicy]) -> None:
    msgs, budget, policy = case
    event("long (>= 50 messages)" if len(msgs) >= 50 else "short")
    check_render("openai", check_fit("openai", msgs, budget, policy) or msgs)


@settings(max_examples=examples(2000))
@given(cases("anthropic"))
def test_anthropic_history_invariants(case: tuple[list[Msg], int, HistoryPolicy]) -> None:
    msgs, budget, policy = case
    event("long (>= 50 messages)" if len(msgs) >= 50 else "short")
    check_render("anthropic", check_fit("anthropic", msgs, budget, policy) or msgs)
