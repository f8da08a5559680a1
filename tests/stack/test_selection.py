"""Selection quality: hybrid retrieval, hot ranked for the question, the composite
and its components on the wire, the packer's weighted score and per-request weights, explain.

Here: the checks through running servers; the pure parts are in
tests/unit/test_selection.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from ibex_context.shared.wire.models import COMPONENTS
from tests.fixtures_services import MemoryServiceHandle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_explain_shows_components(tmp_path: Path) -> None:
    cands = {"hot": [], "cold": [
        {"memory_id": "m1", "content": "Invoices are emailed on the 1st.", "category": "fact", "similarity": 0.8,
         "confidence": 0.9, "rank": 1,
         "components": {"relevance": 0.8, "recency": 0.5, "usefulness": 0.4, "confidence": 0.9, "access": 0.2}}]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cands))
    out = subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "explain", "--request",
                          str(EXAMPLES / "request.json"), "--candidates", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "composite score" in out.stdout and "relevance 0.800" in out.stdout and "access 0.200" in out.stdout


# --------------------------------------------------------------------- the memory service, HTTP


def _mem(content: str, **kw: Any) -> dict[str, Any]:
    return {"org_id": "acme", "agent_id": "bot", "content": content, "category": kw.pop("category", "fact"),
            "confidence": kw.pop("confidence", 0.8), **kw}


def test_hits_carry_relevance_composite_and_components(memory: MemoryServiceHandle) -> None:
    memory.seed([_mem("Invoices for Acme Backup are emailed on the 1st", memory_id="inv", hot=True, salience=0.2),
                 _mem("Dana closed the annual plan milestone today", memory_id="dana", hot=True, salience=0.99,
                      access_count=120, usefulness=0.9),
                 _mem("The escalation path for SSO login is the team lead", memory_id="sso")])
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        h = memory.headers("acme")
        plain = http.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=h).json()["memories"]
        assert [m["memory_id"] for m in plain] == ["dana", "inv"]  # by salience, no extras without a query
        assert "components" not in plain[0] and plain[0]["similarity"] == 0.99
        question = {"agent_id": "bot", "query": "When are Acme Backup invoices emailed?"}
        asked = http.get("/v1/memories/hot", params=question, headers=h).json()["memories"]
        assert [m["memory_id"] for m in asked] == ["inv", "dana"]  # ranked for the question
        inv = asked[0]
        assert inv["salience"] == 0.2 and inv["similarity"] == 0.2 and set(inv["components"]) == set(COMPONENTS)
        assert inv["relevance"] == pytest.approx(inv["components"]["relevance"])
        spec = (0.40, 0.25, 0.20, 0.10, 0.05)
        assert inv["composite"] == pytest.approx(sum(w * inv["components"][k] for w, k in zip(spec, COMPONENTS,
                                                                                               strict=True)), abs=1e-5)
        found = http.post("/v1/memories/search", headers=h, json={
            "query": "Acme Backup invoices emailed", "agent_id": "bot", "min_similarity": 0.0}).json()["memories"]
        assert found[0]["memory_id"] == "inv" and found[0]["relevance"] == found[0]["similarity"]
        assert set(found[0]["components"]) == set(COMPONENTS) and "salience" not in found[0]
        before = http.get("/healthz").json()["queries_truncated"]
        long_q = http.get("/v1/memories/hot", params={"agent_id": "bot", "query": "invoice " * 1000}, headers=h)
        assert long_q.status_code == 200 and http.get("/healthz").json()["queries_truncated"] == before + 1


def test_hot_query_stays_in_its_org(memory: MemoryServiceHandle) -> None:
    memory.seed([_mem("acme secret invoice", memory_id="a1", hot=True),
                 {**_mem("globex secret invoice", memory_id="g1", hot=True), "org_id": "globex"}])
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        got = http.get("/v1/memories/hot", params={"agent_id": "bot", "query": "secret invoice"},
                       headers=memory.headers("globex")).json()["memories"]
    assert [m["memory_id"] for m in got] == ["g1"]


def test_search_keeps_full_text_hits_below_the_cutoff(memory: MemoryServiceHandle) -> None:
    memory.seed([_mem("zebra quartz invoice", memory_id="kw"), _mem("a note on something else", memory_id="other")])
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        got = http.post("/v1/memories/search", headers=memory.headers("acme"), json={
            "query": "zebra quartz details please", "agent_id": "bot",
            "min_similarity": 0.99}).json()["memories"]
    # The cosine is far under 0.99, but two of the four words match: in by its text score, which lifts
    # its relevance above its cosine.
    assert [m["memory_id"] for m in got] == ["kw"] and 0.0 < got[0]["text_score"] < 1.0
    assert got[0]["vector_score"] < 0.99 and got[0]["relevance"] > got[0]["vector_score"]


def test_a_search_without_a_cutoff_gets_the_embedders_own(memory: MemoryServiceHandle) -> None:
    """The cutoff belongs to the embedder (cosine scales differ): minilm's is 0.20, hash's the
    spec's 0.70; a search naming ``min_similarity`` gets exactly that (docs/selection-quality.md)."""
    from ibex_context.memory.embedders.embed import HashingEmbedder
    from ibex_context.memory.embedders.minilm import MiniLMEmbedder
    from ibex_context.memory.embedders.static import StaticEmbedder
    from ibex_context.shared.config.settings import Settings

    assert (HashingEmbedder().min_similarity, StaticEmbedder().min_similarity) == (0.70, 0.70)
    assert MiniLMEmbedder().min_similarity == 0.20 and Settings().cold_min_similarity is None
    memory.seed([_mem("用户偏好使用中文回复", memory_id="far")])
    # No word in common for the full-text side (an unspaced clause is one word), cosine 0.58.
    query = "用户偏好中文"
    cosine = float(HashingEmbedder().embed_query(query) @ HashingEmbedder().embed_query("用户偏好使用中文回复"))
    assert 0.30 < cosine < 0.70
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        def ids(**cut: float) -> list[str]:
            return [m["memory_id"] for m in http.post("/v1/memories/search", headers=memory.headers("acme"), json={
                "query": query, "agent_id": "bot", **cut}).json()["memories"]]
        assert ids() == ids(min_similarity=0.70) == [] and ids(min_similarity=0.0) == ["far"]
