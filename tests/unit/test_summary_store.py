"""Stored compaction summaries: one format (``shared.stores.summaries``), one tenant-scoped key
(``shared.stores.keys.summary_key``), and the worker's read of it in the directive's round trip against
the real Redis and memory service, in process and through a real stack.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_summary_store.py.
"""

from __future__ import annotations

import pytest

from ibex_context.shared.stores.keys import summary_key
from ibex_context.shared.stores.summaries import decode_summary, encode_summary
from ibex_context.shared.wire.models import AssembleRequest, SummarySlot

# --------------------------------------------------------------------------- the format and the key

def test_summary_key_is_scoped_by_org_and_agent_and_checks_every_part() -> None:
    assert summary_key("acme", "bot", "conv:2026-01.a_b") == "{acme}:summary:bot:conv:2026-01.a_b"
    for org, agent, key in (("ac:me", "bot", "k"), ("acme", "b:ot", "k"), ("acme", "bot", "a b"),
                            ("acme", "bot", "k/1"), ("acme", "bot", ""), ("acme", "bot", "k" * 129),
                            ("acme", "bot", "{x}")):
        with pytest.raises(ValueError):
            summary_key(org, agent, key)


def test_encode_then_decode_is_the_summary_and_bad_values_are_problems_not_exceptions() -> None:
    raw = encode_summary("the story so far", 6)
    assert decode_summary(raw) == SummarySlot(text="the story so far", covers=6)
    assert decode_summary(b'{"text": "t", "covers": 1, "made_by": "hook", "at": 1}') == SummarySlot(text="t", covers=1)
    for bad, says in ((b"{not json", "not JSON"), (b"[1, 2]", "not a JSON object"),
                      (b'{"covers": 1}', "text"), (b'{"text": "", "covers": 1}', "text"),
                      (b'{"text": "t", "covers": -1}', "covers"), (b'{"text": "t", "covers": true}', "covers"),
                      (b'{"text": "t", "covers": "3"}', "covers"), (b"\xff\xfe", "not JSON")):
        problem = decode_summary(bad)
        assert isinstance(problem, str) and says in problem, (bad, problem)
    for text, covers in (("", 1), ("x" * 32_001, 1), ("t", -1)):
        with pytest.raises(ValueError):
            encode_summary(text, covers)


def test_a_summary_key_the_wire_would_refuse_is_refused_on_the_request() -> None:
    with pytest.raises(ValueError):
        AssembleRequest.model_validate({"request_id": "r", "org_id": "acme", "agent_id": "bot", "model": "gpt-4o",
                                        "query": "q", "deadline_ns": 1, "summary_key": "a b"})
