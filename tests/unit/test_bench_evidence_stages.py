"""bench.evidence_stages' report: shares per stage and where each question's evidence was lost."""

from __future__ import annotations

from bench.evidence_stages import FUNNEL, STAGES, report


def _q(category: str, missing: set[str], tokens: int) -> dict[str, object]:
    found = {s: s not in missing for s in STAGES}
    return {"category": category, "found": found, "lost_at": next((s for s in FUNNEL if not found[s]), "-"),
            "packed_tokens": tokens}


def test_the_report_counts_each_stage_and_the_first_loss() -> None:
    result = {"settings": {"rerank_depth": 200}, "questions": {
        "a": _q("single-hop", set(), 100),
        "b": _q("single-hop", {"vectors", "reranked pool", "search@10", "answered", "packed"}, 100),
        "c": _q("open-domain", {"text", "vectors", "pool", "fused@10", "reranked pool", "search@10", "answered",
                                "packed"}, 200)}}
    lines = report(result)
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ") for line in lines if line.startswith("| ")}
    single, everyone = rows["single-hop"], rows["all answerable"]
    assert single[1] == "2" and single[2 + STAGES.index("text")] == "1.000"
    assert single[2 + STAGES.index("packed")] == "0.500" and single[-2] == "0 / 1 / 0 / 0"
    assert single[-1] == "100 / 100"
    assert everyone[1] == "3" and everyone[-2] == "1 / 1 / 0 / 0" and everyone[2 + STAGES.index("pool")] == "0.667"
    assert "multi-hop" not in rows  # a category without questions has no row
