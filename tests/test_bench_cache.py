"""bench.cache: the prefix-reuse benchmark runs end to end and its numbers are well-formed
(README "Chat-native assembly"); no ratio or speed is asserted here, the run reports those."""

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


def test_scripts_are_deterministic_agent_conversations_with_tool_calls() -> None:
    for name in cache.SCRIPTS:
        conv = cache.conversation(name, 41)  # turn 20's tool result
        assert conv == cache.conversation(name, 41)
        assert sum(1 for m in conv if m.get("tool_calls")) == 21 and conv[-1]["role"] == "tool"
    pool = cache.load_memories()["support-bot"]
    assert [h.content for h in cache.turn_hits(pool, 3)] != [h.content for h in cache.turn_hits(pool, 4)]


def test_smoke_run_prints_a_table_and_writes_fractions_in_unit_range(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cache.main(["--scripts", "support", "--turns", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(cache.FORMATS) * len(cache.LAYOUTS)
    rows = json.loads((tmp_path / "cache.json").read_text())["rows"]
    assert {(r["format"], r["layout"]) for r in rows} == {(f, la) for f in cache.FORMATS for la in cache.LAYOUTS}
    for r in rows:
        assert len(r["per_turn"]) == 6 and r["cost_usd"] > 0
        for p in r["per_turn"]:
            assert 0.0 <= p["reuse"] <= p["bound"] <= 1.0 and 0 <= p["prefix"] <= p["tokens"]


def test_unknown_script_is_refused() -> None:
    with pytest.raises(SystemExit):
        cache.main(["--scripts", "nope"])
