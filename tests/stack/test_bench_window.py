"""``bench.retrieval --suite conversations`` reports evidence in the whole packed window: per answerable
question whether an evidence turn was packed anywhere, and the memory tokens packed per question,
through a real stack."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.conversations import load_set, report, run_suite, to_json

pytestmark = pytest.mark.timeout(90)


def test_evidence_in_packed_and_tokens_per_question(tmp_path: Path) -> None:
    turns, questions = load_set(sessions=2, conversations=[1])
    asked = [q for q in questions if q.category != "no-answer"][:3] + [q for q in questions
                                                                       if q.category == "no-answer"][:1]
    res = asyncio.run(run_suite(turns, asked, embedder="hash", log_dir=tmp_path / "stack"))
    assert res.errors == 0
    answerable = {q.qid for q in asked if q.category != "no-answer"}
    assert set(res.in_packed) == answerable and set(res.packed_tokens) == {q.qid for q in asked}
    for q in asked:
        if q.qid in answerable:  # packed anywhere is at least found in the first 10
            assert res.in_packed[q.qid] >= res.per_question["stack"][q.qid]["hit@10"]
        assert res.packed_tokens[q.qid] > 0  # two sessions of turns: something is always packed
    text = "\n".join(report(res, asked))
    assert "### Evidence in the window" in text and "| all answerable | 3 |" in text
    doc = to_json(res, asked)
    assert doc["evidence_in_packed"] == res.in_packed and doc["packed_tokens"] == res.packed_tokens
