"""The conversation set's people and open-domain questions: labelled by construction, each evidence
turn said by the person asked about, and drawn after the older questions so those stay as they were."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text("utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def turns() -> dict[str, str]:
    return {t["memory_id"]: t["content"] for t in _jsonl("conversations.jsonl")}


@pytest.fixture(scope="module")
def questions() -> list[dict[str, Any]]:
    return _jsonl("conversation_questions.jsonl")


def test_people_questions_are_answered_by_the_owners_own_words(turns: dict[str, str],
                                                               questions: list[dict[str, Any]]) -> None:
    people = [q for q in questions if q["category"] == "people"]
    assert len(people) >= 20
    for q in people:
        m = re.fullmatch(r"How is (\w+) related to (\w+)\?", q["question"])
        assert m is not None, q["id"]
        kin, owner = m.groups()
        relation = q["answer"].removeprefix(f"{owner}'s ")
        for mid in q["evidence"]:
            text = turns[mid]
            assert text.startswith(f"{owner}: ") and kin in text and relation in text, (q["id"], text)


def test_open_domain_questions_name_their_owner_and_rest_on_the_owners_statements(
        turns: dict[str, str], questions: list[dict[str, Any]]) -> None:
    inferred = [q for q in questions if q["category"] == "open-domain"]
    assert len(inferred) >= 20
    for q in inferred:
        assert q["answer"].startswith("Yes: "), q["id"]
        owners = {turns[mid].split(":", 1)[0] for mid in q["evidence"]}
        assert len(owners) == 1 and owners.pop() in q["question"], q["id"]


def test_new_questions_come_after_the_older_ones_of_each_conversation(questions: list[dict[str, Any]]) -> None:
    for conv in {q["conversation"] for q in questions}:
        cats = [q["category"] for q in questions if q["conversation"] == conv]
        first_new = min(i for i, c in enumerate(cats) if c in ("people", "open-domain"))
        assert all(c in ("people", "open-domain") for c in cats[first_new:]), conv
        assert first_new == 64  # the older 64 questions per conversation, numbered as before
