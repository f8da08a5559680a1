"""``python -m bench.retrieval --suite conversations`` end to end on a slice of one chat, through a real
stack (embedded Redis, memory service, broker, worker), and its pure parts (BM25, judging).

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_bench_conversations.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.conversations import BM25, METRICS, judge, load_set

pytestmark = pytest.mark.timeout(90)


def test_judge_counts_hits_recall_and_reciprocal_rank() -> None:
    m = judge(["a", "b", "c", "d", "e", "f"], frozenset({"c", "z"}))
    assert m["hit@1"] == 0.0 and m["hit@5"] == 1.0 and m["hit@10"] == 1.0
    assert m["recall@1"] == 0.0 and m["recall@5"] == 0.5 and m["recall@10"] == 0.5
    assert m["mrr"] == pytest.approx(1 / 3)
    assert judge([], frozenset({"a"})) == dict.fromkeys(METRICS, 0.0)


def test_bm25_matches_the_okapi_formula() -> None:
    texts = ["Ana: the cello lessons start today", "Ben: cello cello practice", "Ana: we adopted a dog",
             "Ben: that's awesome"]
    ids = ["t1", "t2", "t3", "t4"]
    bm = BM25(ids, texts)
    # Terms (stop words out, plurals stemmed): t1 ana cello lesson start today (5), t2 ben cello cello practice (4),
    # t3 ana adopted dog (3), t4 ben awesome (2: "that's" splits into stop words "that" and "s").
    avg = (5 + 4 + 3 + 2) / 4
    idf = math.log(1 + (4 - 2 + 0.5) / (2 + 0.5))  # "cello" is in two of four turns

    def w(tf: int, length: int) -> float:
        return idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / avg))

    assert bm.rank("cello", 10) == ["t2", "t1"]  # two mentions in a shorter turn first
    scores = bm.weights[:, bm.col["cello"]] * bm.idf[bm.col["cello"]]
    assert scores[1] == pytest.approx(w(2, 4), rel=1e-5) and scores[0] == pytest.approx(w(1, 5), rel=1e-5)
    assert bm.rank("the and of", 10) == []  # only stop words: nothing to rank by


def test_load_set_keeps_only_sessions_and_questions_asked(tmp_path: Path) -> None:
    turns, questions = load_set(sessions=2, conversations=[1])
    assert turns and {t["agent_id"] for t in turns} == {"conv-1"}
    assert all(int(t["memory_id"].split("-s")[1][:2]) <= 2 for t in turns)
    ids = {t["memory_id"] for t in turns}
    assert all(q.evidence <= ids for q in questions)
    assert len(load_set(limit=7)[1]) == 7
