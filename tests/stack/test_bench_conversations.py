"""``python -m bench.retrieval --suite conversations`` end to end on a slice of one chat, through a real
stack (embedded Redis, memory service, broker, worker), and its pure parts (BM25, judging).

Here: the checks through running servers; the pure parts are in
tests/unit/test_bench_conversations.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.conversations import RETRIEVERS, load_set, report, run_suite, to_json

pytestmark = pytest.mark.timeout(90)


def test_suite_end_to_end_on_two_sessions_through_the_real_stack(tmp_path: Path) -> None:
    turns, questions = load_set(sessions=2, conversations=[1])
    asked = [q for q in questions if q.category != "no-answer"][:3] + [q for q in questions
                                                                       if q.category == "no-answer"][:1]
    assert len(asked) == 4
    res = asyncio.run(run_suite(turns, asked, embedder="hash", log_dir=tmp_path / "stack"))
    assert res.errors == 0
    answerable = [q for q in asked if q.category != "no-answer"]
    for name in RETRIEVERS:
        assert set(res.per_question[name]) == {q.qid for q in answerable}
        for q in answerable:
            ranking = res.rankings[name][q.qid]
            assert ranking and set(ranking) <= {t["memory_id"] for t in turns}, (name, q.qid)
    assert len(res.none_cold) == 1 and len(res.none_packed) == 1
    text = "\n".join(report(res, asked))
    assert "plain BM25" in text and "| no-answer questions | 1 |" in text
    json.dumps(to_json(res, asked))
