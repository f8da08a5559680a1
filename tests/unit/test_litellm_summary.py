"""The hook's summary planning (client/integrations/litellm/summary.py) on real assemblies: the
pipeline fits a real conversation (``pipeline.assemble`` with no retrieval), and the hook picks
its next ``covers`` from that reply: on a unit boundary (a tool call with its results), at least
what was dropped, bringing the kept history to the low-water mark; its conversation key; the
config's checks.
"""

from __future__ import annotations

from typing import Any

import pytest

from ibex_context.client.integrations.litellm.config import HookConfigError, parse_config
from ibex_context.client.integrations.litellm.summary import Plan, choose_covers, conversation_key, due, transcript
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation.summary import check_covers
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import Turns
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse

CATALOG = Catalog.load()
FILL = "words of a long turn " * 30


def _conversation(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for n in range(turns):
        out.append({"role": "user", "content": f"FACT-{n} {FILL}"})
        if n % 2:
            call = {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            out += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{n}", "content": f"result {n} {FILL}"}]
        out.append({"role": "assistant", "content": f"answer {n}"})
    out.append({"role": "user", "content": "and now?"})
    return out


def _assembled(messages: list[dict[str, Any]]) -> AssembleResponse:
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model="gpt-4", query="and now?",
                          format="openai", messages=messages, deadline_ns=1 << 62)
    return assemble(req, offline_result(directive=None, hot=[], cold=[]), Engine(CATALOG, Policy()))


def test_a_long_conversation_is_due_and_its_covers_lands_on_a_unit_boundary() -> None:
    messages = _conversation(40)
    resp = _assembled(messages)
    assert resp.history_dropped_upto > 0 and due(resp, 0.8)  # trimmed with no summary: due
    covers = choose_covers("openai", messages, resp, low_water=0.5, summary_tokens=1000)
    assert covers is not None and covers >= resp.history_dropped_upto
    assert check_covers(Turns("openai", "openai", messages, []), covers) is None
    budget = resp.budget
    shares = sum(len(str(m)) for m in messages)
    kept = [m for m in [m for m in messages if m["role"] != "system"][covers:]]
    assert sum(len(str(m)) for m in kept) < shares  # something is left out, the latest turn stays
    assert kept[-1]["content"] == "and now?"
    assert budget.messages_tokens > 0


def test_a_short_conversation_is_not_due() -> None:
    resp = _assembled(_conversation(2))
    assert not due(resp, 0.8)


def test_the_transcript_holds_the_previous_summary_and_only_the_new_span() -> None:
    messages = _conversation(6)
    plan = Plan("acme", "bot", "k", covers=6, prev_covers=2, prev_text="FACT-0", messages=messages,
                format="openai")  # [user 0, answer 0] summarized; [user 1, call, result, answer 1] to fold
    text = transcript(plan)
    assert text.startswith("Previous summary:\nFACT-0")
    assert "FACT-1 words" in text and "FACT-0 words" not in text and "FACT-2" not in text
    assert "[assistant] calls f({})" in text and "[tool] result 1" in text


def test_the_conversation_key_is_the_session_or_a_stable_digest() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    assert conversation_key({}, {"litellm_session_id": "abc-1"}, "acme", "bot", msgs) == "s:abc-1"
    assert conversation_key({"litellm_trace_id": "t 1"}, {}, "acme", "bot", msgs).startswith("s:")
    a = conversation_key({}, {}, "acme", "bot", msgs)
    assert a == conversation_key({}, {}, "acme", "bot", [*msgs, {"role": "assistant", "content": "hi"}])
    assert a != conversation_key({}, {}, "acme", "other", msgs)
    assert len(a) <= 128


def test_the_config_checks_its_marks() -> None:
    base = {"orgs": {"acme": {}}}
    cfg = parse_config({**base, "summaries": {"model": "m"}})
    assert cfg.summaries is not None and cfg.summaries.max_chars == 4000 and cfg.summaries.as_memory
    with pytest.raises(HookConfigError, match="low_water"):
        parse_config({**base, "summaries": {"model": "m", "high_water": 0.5, "low_water": 0.6}})
    assert parse_config(base).summaries is None
