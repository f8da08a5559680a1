"""The hook's next ``covers`` from one split of the conversation (``pipeline.conversation.summary.cover_boundaries``,
``litellm_summary.choose_covers``), held to the answer of asking ``check_covers`` of every count:
the boundaries are exactly the counts ``check_covers`` accepts, exhaustively on every short
conversation shape and by property on long ones (tool groups, system and developer messages
anywhere, orphaned halves, OpenAI and Anthropic forms); the chosen ``covers`` is the one the
count-by-count reference (``reference_covers``, kept here only) chooses, on real assemblies and on
replies with any drops, placed summary and budget, including thresholds that tie the reference's
own float sum; and the plan stays linear on a 3,202-message conversation.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from bench.litellm import TOOLS, long_conversation
from ibex_context.client.integrations.litellm.summary import _cost_shares, _first_within, choose_covers
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation.summary import check_covers, cover_boundaries, non_system
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import Turns
from ibex_context.shared.wire.errors import ContextOverflow
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse, HistoryDecision, SummaryReport
from tests.properties import examples
from tests.unit.test_chat_assembly import SMALL_CLAUDE, anthropic_conversations, conversations

CATALOG = Catalog.load()
CALL = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
OPENAI_KINDS: list[dict[str, Any]] = [
    {"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c", "content": "r"}]
ANTHROPIC_KINDS: list[dict[str, Any]] = [
    {"role": "user", "content": "u"}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}, {"type": "text", "text": "u"}]},
    {"role": "assistant", "content": "a"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "lookup", "input": {}}]},
    {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
EXTRA_KINDS = {"openai": [{"role": "assistant", "content": "a", "tool_calls": []},  # no calls: a message of its own
                          {"role": "user", "content": [{"type": "text", "text": "u"}]}],
               "anthropic": [{"role": "system", "content": "s"}, {"role": "user", "content": ["u"]},
                             {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                               {"type": "tool_use", "id": "t", "name": "f"}]}]}
KINDS = {"openai": OPENAI_KINDS, "anthropic": ANTHROPIC_KINDS}


def reference_covers(fmt: str, messages: list[Any], assembly: AssembleResponse, *, low_water: float,
                     summary_tokens: int) -> int | None:
    """``choose_covers`` as it was, one ``check_covers`` and one sum over the messages per count: the
    answer the one-split plan must give."""
    turns = Turns(format=fmt, target=fmt, messages=messages, tools=[])  # type: ignore[arg-type]
    budget = assembly.budget
    available = budget.messages_tokens + max(0, budget.unclamped)
    placed = assembly.summary.covers if assembly.summary is not None and assembly.summary.placed else 0
    at_least = max(placed + 1, assembly.history_dropped_upto)
    dropped = {d.index for d in assembly.history}
    kept = [i for i in range(len(messages)) if i not in dropped]
    shares = _cost_shares(messages, kept, budget.messages_tokens)
    ns = non_system(turns)
    fits = [c for c in range(at_least, len(ns) + 1) if check_covers(turns, c) is None]
    if not fits:
        return None
    for c in fits:
        covered = set(ns[:c])
        rest = sum(v for i, v in shares.items() if i not in covered)
        if rest + summary_tokens <= low_water * available:
            return c
    return fits[-1]


def _accepted(fmt: str, messages: list[Any]) -> list[int]:
    turns = Turns(format=fmt, target=fmt, messages=messages, tools=[])  # type: ignore[arg-type]
    return [c for c in range(len(non_system(turns)) + 1) if check_covers(turns, c) is None]


def _boundaries(fmt: str, messages: list[Any]) -> list[int]:
    return cover_boundaries(Turns(format=fmt, target=fmt, messages=messages, tools=[]))  # type: ignore[arg-type]


@st.composite
def shapes(draw: Any, fmt: str, max_size: int = 40) -> list[dict[str, Any]]:
    """Any sequence of the format's message kinds (valid or not: orphaned calls and results,
    system messages anywhere), with text of varied length so the messages' shares differ."""
    kinds = KINDS[fmt] + EXTRA_KINDS[fmt]
    out = []
    for k in draw(st.lists(st.integers(0, len(kinds) - 1), max_size=max_size)):
        message = dict(kinds[k])
        if isinstance(message["content"], str):
            message["content"] = message["content"] * draw(st.integers(1, 60))
        out.append(message)
    return out


def test_the_boundaries_are_every_count_check_covers_accepts_on_every_short_conversation() -> None:
    seen = 0
    for fmt, kinds in KINDS.items():
        for n in range(6):
            for combo in itertools.product(kinds, repeat=n):
                messages = list(combo)
                assert _boundaries(fmt, messages) == _accepted(fmt, messages), (fmt, messages)
                seen += 1
    assert seen == 2 * sum(6 ** n for n in range(6))


@settings(max_examples=examples(300), deadline=None)
@given(st.one_of(st.tuples(st.just("openai"), shapes("openai")), st.tuples(st.just("anthropic"), shapes("anthropic")),
                 st.tuples(st.just("openai"), conversations()),
                 st.tuples(st.just("anthropic"), anthropic_conversations())))
def test_property_the_boundaries_are_every_count_check_covers_accepts(case: tuple[str, list[Any]]) -> None:
    fmt, messages = case
    got = _boundaries(fmt, messages)
    event(f"{len(got) - 1} boundaries past 0" if len(got) < 4 else "4+ boundaries")
    assert got == _accepted(fmt, messages)


def _base() -> AssembleResponse:
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model="gpt-4", query="q", format="openai",
                          messages=[{"role": "user", "content": "hi"}], deadline_ns=1 << 62)
    return assemble(req, offline_result(directive=None, hot=[], cold=[]), Engine(CATALOG, Policy()))


BASE = _base()


def _reply(*, tokens: int, unclamped: int, dropped: set[int], upto: int,
           summary: SummaryReport | None) -> AssembleResponse:
    """The base reply with the fields the plan reads set (what a worker may answer for any conversation)."""
    budget = BASE.budget.model_copy(update={"messages_tokens": tokens, "unclamped": unclamped})
    history = [HistoryDecision(index=i, role="user", tokens=1, reason="trim_oldest") for i in sorted(dropped)]
    return BASE.model_copy(update={"budget": budget, "history": history, "history_dropped_upto": upto,
                                   "summary": summary})


def _tie(fmt: str, messages: list[Any], reply: AssembleResponse, summary_tokens: int, pick: int, step: int) -> float:
    """A ``low_water`` whose limit lands on (or a float step either side of) what the reference
    sums for one of the candidates: where two orders of one sum can disagree."""
    turns = Turns(format=fmt, target=fmt, messages=messages, tools=[])  # type: ignore[arg-type]
    ns = non_system(turns)
    fits = [c for c in cover_boundaries(turns) if c >= 1] or [0]
    covered = set(ns[:fits[pick % len(fits)]])
    dropped = {d.index for d in reply.history}
    shares = _cost_shares(messages, [i for i in range(len(messages)) if i not in dropped], reply.budget.messages_tokens)
    rest = sum(v for i, v in shares.items() if i not in covered) + summary_tokens
    available = reply.budget.messages_tokens + max(0, reply.budget.unclamped)
    return _step(rest / available if available else 0.5, step)


@settings(max_examples=examples(400), deadline=None)
@given(st.data(), st.sampled_from(["openai", "anthropic"]))
def test_property_choose_covers_is_the_reference_on_any_reply(data: st.DataObject, fmt: str) -> None:
    messages = data.draw(shapes(fmt))
    n = len(messages)
    covers = st.integers(0, n // 4) | st.integers(0, n + 1)  # mostly small: a covers past it leaves nothing
    placed = data.draw(st.none() | st.builds(SummaryReport, covers=covers, tokens=st.just(0), placed=st.booleans(),
                                             source=st.just("stored")))
    reply = _reply(tokens=data.draw(st.integers(0, 20_000)), unclamped=data.draw(st.integers(-5_000, 5_000)),
                   dropped=data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n)) if n else set(),
                   upto=data.draw(st.integers(0, n // 4) | st.integers(0, n + 1)), summary=placed)
    summary_tokens = data.draw(st.integers(0, 5_000))
    if data.draw(st.booleans()):
        low_water = _tie(fmt, messages, reply, summary_tokens, data.draw(st.integers(0, 50)),
                         data.draw(st.integers(-3, 3)))
        event("a tie on the reference's sum")
    else:
        low_water = data.draw(st.floats(0.0, 1.0))
    want = reference_covers(fmt, messages, reply, low_water=low_water, summary_tokens=summary_tokens)
    event("no covers" if want is None else "a covers")
    assert choose_covers(fmt, messages, reply, low_water=low_water, summary_tokens=summary_tokens) == want


@settings(max_examples=examples(150), deadline=None)
@given(st.one_of(st.tuples(st.just("openai"), conversations()),
                 st.tuples(st.just("anthropic"), anthropic_conversations())),
       st.floats(0.0, 0.99), st.integers(0, 2_000))
def test_property_choose_covers_is_the_reference_on_real_assemblies(case: tuple[str, list[Any]], low_water: float,
                                                                    summary_tokens: int) -> None:
    fmt, messages = case
    model, catalog = ("gpt-4", CATALOG) if fmt == "openai" else ("claude-small", SMALL_CLAUDE)
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model=model, query="q",
                          format=fmt, messages=messages, deadline_ns=1 << 62)  # type: ignore[arg-type]
    try:
        reply = assemble(req, offline_result(directive=None, hot=[], cold=[]), Engine(catalog, Policy()))
    except ContextOverflow:
        event("overflow")
        return
    event("trimmed" if reply.history else "fits whole")
    want = reference_covers(fmt, messages, reply, low_water=low_water, summary_tokens=summary_tokens)
    assert choose_covers(fmt, messages, reply, low_water=low_water, summary_tokens=summary_tokens) == want


def _long_reply(turns: int) -> tuple[list[dict[str, Any]], AssembleResponse]:
    """The bench's support session (``bench.litellm --summaries``: 802 messages at 200 turns) as the
    worker fits it on gpt-4's 8K window."""
    messages = long_conversation(turns)
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model="gpt-4", query="q", format="openai",
                          messages=messages, tools=TOOLS, deadline_ns=1 << 62)
    return messages, assemble(req, offline_result(directive=None, hot=[], cold=[]), Engine(CATALOG, Policy()))


def test_the_bench_conversation_gets_the_reference_covers_at_every_low_water() -> None:
    messages, reply = _long_reply(200)
    assert len(messages) == 802 and reply.history_dropped_upto > 0
    chosen = []
    for low_water, summary_tokens in ((0.0, 0), (0.25, 1000), (0.5, 1000), (0.75, 0), (0.99, 0), (1.0, 0)):
        want = reference_covers("openai", messages, reply, low_water=low_water, summary_tokens=summary_tokens)
        chosen.append(choose_covers("openai", messages, reply, low_water=low_water, summary_tokens=summary_tokens))
        assert chosen[-1] == want
    assert len(set(chosen)) == len(chosen)  # the last boundary, the first, and some between


def test_a_near_tie_is_decided_by_the_kept_messages_own_order() -> None:
    # Covering message 1 leaves messages 0 (a system message), 2 and 3: 0.1 + 0.2 + 0.3 is
    # 0.6000000000000001 in their own order, over a limit of 0.6; the running sums add the same
    # shares as 0.1 + (0.2 + 0.3), which is 0.6 and within it
    assert 0.1 + 0.2 + 0.3 > 0.6 == 0.1 + (0.2 + 0.3)
    shares, ns = {0: 0.1, 1: 0.4, 2: 0.2, 3: 0.3}, [1, 2, 3]
    assert _first_within([1], ns, shares, 0, 0.6, 4) is None
    assert _first_within([1, 2], ns, shares, 0, 0.6, 4) == 2  # leaves 0.1 + 0.3
    assert _first_within([1, 2], ns, shares, 0, math.nextafter(0.6, 1.0), 4) == 1
    # two near candidates: covering message 2 (1e-15) too takes the sum back to the limit; message
    # 1 was dropped, so the first leaves 0, 2, 3, 4 and the second 0, 3, 4, each summed on its own
    shares, ns = {0: 0.1, 2: 1e-15, 3: 0.2, 4: 0.3}, [1, 2, 3, 4]
    assert _first_within([1, 2], ns, shares, 0, 0.1 + 0.2 + 0.3, 5) == 2


@settings(max_examples=examples(400), deadline=None)
@given(st.data())
def test_property_first_within_is_the_sum_in_the_kept_order(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40))
    ns = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    value = (st.builds(lambda a, b: a / b, st.integers(0, 10**6), st.integers(1, 10**4))  # as shares are made
             | st.floats(0.0, 1e6) | st.sampled_from([0.1, 0.2, 0.3, 0.7, 1e-300, 5e-324]))
    shares = {i: data.draw(value) for i in sorted(data.draw(st.sets(st.integers(0, n - 1))))}
    fits = sorted(data.draw(st.sets(st.integers(1, len(ns)), min_size=1)))
    summary_tokens = data.draw(st.integers(0, 10))

    def rest(c: int) -> float:
        covered = set(ns[:c])
        return sum(v for i, v in shares.items() if i not in covered) + summary_tokens

    near = st.tuples(st.sampled_from([rest(c) for c in fits]), st.integers(-3, 3)).map(lambda t: _step(*t))
    limit = data.draw(near | st.floats(0.0, 4e7) | st.sampled_from([math.inf, -math.inf, math.nan]))
    want = next((c for c in fits if rest(c) <= limit), None)
    assert _first_within(fits, ns, shares, summary_tokens, limit, n) == want


def _step(x: float, steps: int) -> float:
    """``x`` moved ``steps`` floats up (or down)."""
    for _ in range(abs(steps)):
        x = math.nextafter(x, math.copysign(math.inf, steps))
    return x


def test_the_plan_is_linear_in_the_conversation() -> None:
    # 3,202 messages, all kept, with every one of their 2,400 boundaries a candidate and none enough
    # (low water 0): one check_covers per candidate took 14 s here, the one-split plan 16 ms
    messages = long_conversation(800)
    reply = _reply(tokens=40_000, unclamped=0, dropped=set(), upto=0, summary=None)
    t0 = time.perf_counter()
    covers = choose_covers("openai", messages, reply, low_water=0.0, summary_tokens=1000)
    elapsed = time.perf_counter() - t0
    assert covers == _boundaries("openai", messages)[-1] == len(messages) - 2
    assert elapsed < 0.5, f"choose_covers took {elapsed:.3f} s on {len(messages)} messages"
