"""bench.cache: the prefix-reuse benchmark runs end to end and its numbers are well-formed
(docs/assembly.md "Chat-native assembly"); no ratio or speed is asserted here, the run reports those."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cache


def test_openai_billing_rounds_down_to_128_from_1024() -> None:
    assert cache.openai_cached(1023, 5000) == 0
    assert cache.openai_cached(1024, 5000) == 1024
    assert cache.openai_cached(1300, 5000) == 1280
    assert cache.openai_cached(2000, 1000) == 0  # a prompt under 1,024 tokens is never cached


def test_common_prefix() -> None:
    assert cache.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert cache.common_prefix([], [1]) == 0
    assert cache.common_prefix([1, 2], [1, 2]) == 2


def test_scripts_are_deterministic_agent_conversations_with_tool_loops() -> None:
    for name in cache.SCRIPTS:
        conv = cache.conversation(name, 20, 2)  # turn 20, after its second tool result
        assert conv == cache.conversation(name, 20, 2)
        earlier = sum(cache.tool_calls_in_turn(t) for t in range(20))
        assert sum(1 for m in conv if m.get("tool_calls")) == earlier + 2 and conv[-1]["role"] == "tool"
        assert cache.conversation(name, 20, 3)[:len(conv)] == conv  # a tool loop only appends
    assert {cache.tool_calls_in_turn(t) for t in range(6)} == {1, 2, 3}
    assert len(cache.model_calls(3)) == sum(cache.tool_calls_in_turn(t) + 1 for t in range(3)) == 9
    pool = cache.load_memories()["support-bot"]
    assert [h.content for h in cache.turn_hits(pool, 3)] != [h.content for h in cache.turn_hits(pool, 4)]


def test_memories_change_per_turn_or_per_call() -> None:
    """'turn': one draw per user question, so a turn's tool-loop calls see the same memories;
    'call': a new draw every model call."""
    rows = {r["churn"]: r for churn in cache.CHURNS
            for r in cache.run_script(cache.Catalog.load(), "support", 2, _enc(), churn)
            if r["format"] == "openai" and r["layout"] == "service"}
    per_turn, per_call = rows["turn"]["per_turn"], rows["call"]["per_turn"]
    assert [(p["turn"], p["step"]) for p in per_turn] == cache.model_calls(2)
    # Turn 1's tool-loop calls append to the previous prompt when the memories stay the same (all
    # of it but at most the last token, which BPE may merge with what now follows it).
    loop = [p for p in per_turn if p["turn"] == 1 and p["step"] > 0]
    assert loop and all(p["prefix"] >= round(p["bound"] * p["tokens"]) - 1 for p in loop)
    assert all(p["prefix"] < round(p["bound"] * p["tokens"]) - 1 for p in per_call[1:])


def _enc() -> object:
    return cache.Catalog.load().counter(cache.ENCODING).inner._enc  # type: ignore[attr-defined]


def test_smoke_run_prints_a_table_and_writes_fractions_in_unit_range(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cache.main(["--scripts", "support", "--turns", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(cache.CHURNS) * len(cache.FORMATS) * len(cache.LAYOUTS)
    rows = json.loads((tmp_path / "cache.json").read_text())["rows"]
    assert {(r["churn"], r["format"], r["layout"]) for r in rows} == {
        (c, f, la) for c in cache.CHURNS for f in cache.FORMATS for la in cache.LAYOUTS}
    for r in rows:
        assert len(r["per_turn"]) == len(cache.model_calls(3)) and r["cost_usd"] > 0
        assert 0.0 <= r["weighted_reuse"] <= 1.0
        for p in r["per_turn"]:
            assert 0.0 <= p["reuse"] <= p["bound"] <= 1.0 and 0 <= p["prefix"] <= p["tokens"]


def test_unknown_script_is_refused() -> None:
    with pytest.raises(SystemExit):
        cache.main(["--scripts", "nope"])
