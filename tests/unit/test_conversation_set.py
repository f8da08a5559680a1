"""The conversation evaluation set (bench/data/conversations.jsonl, conversation_questions.jsonl): the
generator is deterministic and the committed files are its output, and every label holds by construction.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_conversation_set.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ibex_context.memory.embedders.embed import content_terms
from ibex_context.memory.service.seed import parse_records

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"
GENERATOR = DATA / "make_conversations.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_conversations", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def turns() -> dict[str, dict[str, Any]]:
    return {t["memory_id"]: t for t in _jsonl(DATA / "conversations.jsonl")}


@pytest.fixture(scope="module")
def questions() -> list[dict[str, Any]]:
    return _jsonl(DATA / "conversation_questions.jsonl")


def test_turns_are_seedable_and_shaped_like_a_long_conversation(turns: dict[str, dict[str, Any]]) -> None:
    memories, directives = parse_records(list(turns.items()), now=datetime.now(UTC))
    assert len(memories) == len(turns) and not directives
    per_agent = Counter(t["agent_id"] for t in turns.values())
    assert len(per_agent) >= 5 and min(per_agent.values()) >= 300
    for agent in per_agent:
        mine = [t for t in turns.values() if t["agent_id"] == agent]
        speakers = Counter(t["content"].split(":", 1)[0] for t in mine)
        assert len(speakers) == 2, speakers  # two named people
        sessions = {t["memory_id"].split("-t")[0] for t in mine}
        assert 15 <= len(sessions) <= 25
        days = sorted({t["created_at"][:10] for t in mine})
        assert len(days) == len(sessions) and days[0] >= "2023-01-01" and days[-1] <= "2024-12-31"


def test_every_evidence_id_is_a_turn_of_its_conversation(turns: dict[str, dict[str, Any]],
                                                        questions: list[dict[str, Any]]) -> None:
    for q in questions:
        for mid in q["evidence"]:
            assert mid in turns, (q["id"], mid)
            assert turns[mid]["agent_id"] == q["agent_id"], (q["id"], mid)


def test_categories_and_counts(questions: list[dict[str, Any]]) -> None:
    counts = Counter(q["category"] for q in questions)
    assert len(questions) >= 300
    assert set(counts) == {"single-hop", "multi-hop", "temporal", "paraphrased", "people", "open-domain", "no-answer"}
    assert all(n >= (20 if c in ("people", "open-domain") else 40) for c, n in counts.items()), counts
    assert len({q["id"] for q in questions}) == len(questions)
    for q in questions:
        n = len(q["evidence"])
        if q["category"] == "no-answer":
            assert n == 0 and q["answer"] == "", q["id"]
        elif q["category"] == "multi-hop":
            assert n >= 2 and len(set(q["evidence"])) == n, q["id"]
        elif q["category"] in ("people", "open-domain"):  # every turn that says it is evidence
            assert n >= 1 and len(set(q["evidence"])) == n, q["id"]
        else:
            assert n == 1, q["id"]
        if q["category"] == "temporal":
            assert q["question"].startswith("When "), q["id"]


def test_multi_hop_cross_session_questions_span_two_sessions(questions: list[dict[str, Any]]) -> None:
    cross = [q for q in questions if q["category"] == "multi-hop"
             and len({mid.split("-t")[0] for mid in q["evidence"]}) >= 2]
    assert len(cross) >= 20


def test_paraphrased_questions_share_no_content_word_with_their_evidence(
        turns: dict[str, dict[str, Any]], questions: list[dict[str, Any]]) -> None:
    """Checked with the memory service's own terms and with the generator's stricter roots."""
    gen = _generator()
    para = [q for q in questions if q["category"] == "paraphrased"]
    assert para
    for q in para:
        for mid in q["evidence"]:
            text = turns[mid]["content"]
            assert not content_terms(q["question"]) & content_terms(text), (q["id"], text)
            assert not gen.content_roots(q["question"]) & gen.content_roots(text), (q["id"], text)


def test_no_answer_questions_name_nothing_the_conversation_has_for_that_person(
        turns: dict[str, dict[str, Any]], questions: list[dict[str, Any]]) -> None:
    """An absent animal, city or instrument is never said anywhere in the conversation."""
    gen = _generator()
    absent = [*gen.ABSENT_SPECIES, *gen.ABSENT_CITIES, *gen.ABSENT_INSTRUMENTS, "brother"]
    for q in questions:
        if q["category"] != "no-answer":
            continue
        said = " ".join(t["content"].casefold() for t in turns.values() if t["agent_id"] == q["agent_id"])
        for word in absent:
            if word.casefold() in q["question"].casefold():
                assert word.casefold() not in said, (q["id"], word)
