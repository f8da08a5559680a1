"""`ibex-context explain`: the offline pipeline, its accounting and its errors.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_explain.py.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

from ibex_context.ops.explain import explain, load_candidates, load_request, run
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.config.settings import Settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NONCE = "00112233445566778899aabbccddeeff"


def test_in_process_explain_matches_budget_invariant() -> None:
    req = load_request(str(EXAMPLES / "request.json"))
    directive, hot, cold = load_candidates(str(EXAMPLES / "candidates.json"))
    resp = explain(req, directive, hot, cold, nonce=NONCE)
    mem = next(s for s in resp.sections if s.name == "memories")
    assert mem.tokens <= resp.packer.total_tokens + resp.budget.formatter_overhead_tokens
    total = sum(s.tokens for s in resp.sections)
    b = resp.budget
    assert total <= b.context_window - b.response_reserve - b.safety_buffer


# ------------------------------------------------------------------------ honest decisions


def _request_doc(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {"request_id": "honest", "org_id": "acme", "agent_id": "bot", "model": "gpt-4",
                              "query": "q"}
    doc.update(over)
    return doc


def _hit(memory_id: str, words: int, similarity: float, **over: object) -> dict[str, object]:
    hit: dict[str, object] = {"memory_id": memory_id, "content": "word " * words, "category": "fact",
                              "similarity": similarity, "confidence": 0.5, "rank": 0}
    hit.update(over)
    return hit


def _explain_files(tmp_path: Path, candidates: dict[str, object], fmt: str = "json") -> tuple[int, str, str]:
    rq, cd = tmp_path / "request.json", tmp_path / "candidates.json"
    rq.write_text(json.dumps(_request_doc()))
    cd.write_text(json.dumps(candidates))
    out, err = io.StringIO(), io.StringIO()
    code = run(argparse.Namespace(request=str(rq), candidates=str(cd), nonce=NONCE, format=fmt), out, err)
    return code, out.getvalue(), err.getvalue()


def _by_id(decisions: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in decisions:
        out.setdefault(str(d["memory_id"]), []).append(d)
    return out


def test_a_memory_larger_than_the_budget_says_so(tmp_path: Path) -> None:
    """gpt-4's 8K window leaves a few thousand tokens: the top-scored 9,000-word memory can never fit,
    and nothing of higher value was packed, so the reason must not claim otherwise."""
    code, out, err = _explain_files(tmp_path, {"hot": [_hit("huge", 9000, 0.99), _hit("small", 5, 0.4)]})
    assert code == 0, err
    doc = json.loads(out)
    usable = doc["budget"]["usable"]
    huge = _by_id(doc["decisions"])["huge"]
    assert [d["decision"] for d in huge] == ["excluded_budget"]
    assert huge[0]["reason"] == f"needs {huge[0]['tokens']} tokens, budget is {usable}"
    assert huge[0]["tokens"] > usable


def test_budget_reason_names_what_was_packed(tmp_path: Path) -> None:
    # ~2,500 tokens each against gpt-4's ~6,600 usable: two of the three fit.
    hot = [_hit("first", 2500, 0.9), _hit("second", 2500, 0.8), _hit("third", 2500, 0.7)]
    code, out, err = _explain_files(tmp_path, {"hot": hot})
    assert code == 0, err
    doc = json.loads(out)
    assert [p["memory_id"] for p in doc["packed"]] == ["first", "second"]
    third = _by_id(doc["decisions"])["third"][0]
    assert third["decision"] == "excluded_budget"
    assert "after 2 memories scoring at least as high (short by " in third["reason"]
    assert "higher-value" not in third["reason"]


def test_top_scored_memory_left_out_for_a_better_total_says_which_scored_lower(tmp_path: Path) -> None:
    usable = json.loads(_explain_files(tmp_path, {})[1])["budget"]["usable"]  # memories do not change it
    # Two memories that just fit together beat one that scores a little higher but fits only alone.
    words = (usable - 40) // 2 - 14  # a memory line is its words plus ~14 tokens of wrapper
    hot = [_hit("top", words * 2 + 20, 0.9), _hit("pair-a", words, 0.85), _hit("pair-b", words, 0.85)]
    code, out, err = _explain_files(tmp_path, {"hot": hot})
    assert code == 0, err
    doc = json.loads(out)
    top = _by_id(doc["decisions"])["top"][0]
    assert sorted(p["memory_id"] for p in doc["packed"]) == ["pair-a", "pair-b"]
    assert top["decision"] == "excluded_budget"
    assert "after 2 packed memories, total score" in top["reason"]
    assert top["reason"].endswith("2 of them score lower: the packer maximises the total score, not each memory's")


def test_duplicates_get_one_decision_per_memory_naming_the_kept_copy(tmp_path: Path) -> None:
    hot = [_hit("a", 5, 0.95, confidence=float("nan")), _hit("b", 5, 0.6, rank=1), _hit("b", 5, 0.6, rank=2)]
    cold = [_hit("a", 5, 0.8), _hit("b", 5, 0.7, rank=0)]
    code, out, err = _explain_files(tmp_path, {"hot": hot, "cold": cold})
    assert code == 0, err
    doc = json.loads(out)
    by_id = _by_id(doc["decisions"])
    assert len(doc["decisions"]) == 5  # every copy has exactly one decision ...
    for mid, copies in by_id.items():  # ... and every memory exactly one that is not "duplicate"
        assert [d["decision"] for d in copies if d["decision"] != "duplicate"] == ["packed"], mid
    assert sorted((p["memory_id"], p["source"]) for p in doc["packed"]) == [("a", "cold"), ("b", "cold")]
    reasons = sorted(str(d["reason"]) for d in doc["decisions"] if d["decision"] == "duplicate")
    assert reasons == [
        "duplicate memory_id: the copy cold #0 (rank 0) was kept (this copy's scores are invalid)",
        "duplicate memory_id: the copy cold #1 (rank 0) was kept (its interim score 0.6700 beats this copy's 0.5850)",
        "duplicate memory_id: the copy cold #1 (rank 0) was kept (its interim score 0.6700 beats this copy's 0.5850)",
    ]


def test_empty_memory_id_is_malformed_not_packed(tmp_path: Path) -> None:
    code, out, err = _explain_files(tmp_path, {"hot": [_hit("ok", 5, 0.9), _hit("", 5, 0.95)]})
    assert code == 0, err
    doc = json.loads(out)
    assert [p["memory_id"] for p in doc["packed"]] == ["ok"]
    bad = [d for d in doc["decisions"] if d["decision"] == "malformed"]
    assert [(d["memory_id"], d["source"]) for d in bad] == [("<hot#1>", "hot")]
    assert bad[0]["reason"] == "memory_id '' must be 1-64 characters of [A-Za-z0-9_.-]"
    assert 'id=""' not in doc["rendered"]
    code, table, err = _explain_files(tmp_path, {"hot": [_hit("ok", 5, 0.9), _hit("", 5, 0.95)]}, fmt="table")
    assert code == 0 and "malformed" in table and "<hot#1>" in table


def test_a_copy_refused_by_retrieval_is_a_duplicate_when_another_copy_was_decided() -> None:
    """Over the branch cap (or malformed) under an id whose other copy was packed: one answer per memory."""
    settings = Settings()
    catalog = Catalog.load(settings.catalog_path)
    hits = [MemoryHit("a", "alpha", "fact", 0.9, 0.5, 0, "hot"), MemoryHit("a", "alpha", "fact", 0.9, 0.5, 1, "hot")]
    retrieval = offline_result(directive=None, hot=hits, cold=[], hot_cap=1)
    req = load_request(str(EXAMPLES / "request.json"))
    resp = assemble(req, retrieval, Engine(catalog, Policy.from_settings(settings)), nonce=NONCE)
    assert [(d.memory_id, d.decision) for d in resp.decisions] == [("a", "duplicate"), ("a", "packed")]
    assert resp.decisions[0].reason == ("duplicate memory_id: the hot copy was kept (packed); "
                                        "this copy was over_cap: beyond the hot cap of 1 hits")
