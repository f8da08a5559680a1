"""Selection quality: hybrid retrieval, hot ranked for the question, the composite
and its components on the wire, the packer's weighted score and per-request weights, explain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from ibex_context.memory.rank import HOT_SALIENCE_SHARE, hot_relevance
from ibex_context.pipeline.score import DEFAULT_WEIGHTS, score_candidates
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import COMPONENTS, AssembleRequest, AssemblyOptions, ScoreWeights
from ibex_context.worker.retrieve import parse_hits
from tests.fixtures_services import MemoryServiceHandle

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

def test_hot_relevance_blends_cosine_and_salience() -> None:
    assert hot_relevance(1.0, 1.0) == pytest.approx(1.0)
    assert hot_relevance(-0.4, 0.5) == pytest.approx(HOT_SALIENCE_SHARE * 0.5)  # negative cosine clips to 0
    assert hot_relevance(float("nan"), 1.0) == pytest.approx(HOT_SALIENCE_SHARE)
    # salience alone never beats a clearly better answer
    assert hot_relevance(0.6, 0.0) > hot_relevance(0.3, 1.0)


# ------------------------------------------------------------------------------ weights, scorer


def test_weights_are_validated_with_a_named_field() -> None:
    w = {"relevance": 0.5, "recency": 0.2, "usefulness": 0.2, "confidence": 0.05, "access": 0.05}
    assert AssemblyOptions.model_validate({"weights": w}).weights == ScoreWeights(**w)
    for bad, where in [({**w, "relevance": 0.6}, "sum to 1"), ({**w, "recency": -0.1, "relevance": 0.8}, "recency"),
                       ({**w, "access": float("inf")}, "access"), ({**w, "bogus": 0.0}, "bogus")]:
        with pytest.raises(ValidationError) as exc:
            AssemblyOptions.model_validate({"weights": bad})
        assert where in str(exc.value)


def _hit(mid: str, sim: float, conf: float, comps: tuple[float, ...] | None, source: Any = "cold") -> MemoryHit:
    return MemoryHit(memory_id=mid, content="x", category="fact", similarity=sim, confidence=conf, rank=1,
                     source=source, components=comps)  # type: ignore[arg-type]


def test_score_is_the_weighted_components_with_request_weights() -> None:
    comps = (0.9, 0.2, 0.5, 0.8, 0.1)
    hits = [_hit("a", 0.9, 0.8, comps), _hit("b", 0.6, 0.6, None)]
    scored, rejected = score_candidates(hits, lambda h: 5)
    assert not rejected
    by = {s.memory_id: s for s in scored}
    assert by["a"].kind == "composite"
    assert by["a"].composite_score == pytest.approx(sum(w * c for w, c in zip(DEFAULT_WEIGHTS, comps, strict=True)))
    assert by["b"].kind == "interim" and by["b"].composite_score == pytest.approx(0.85 * 0.6 + 0.15 * 0.6)
    only_recency = (0.0, 1.0, 0.0, 0.0, 0.0)
    scored, _ = score_candidates(hits, lambda h: 5, weights=only_recency)
    assert {s.memory_id: s.composite_score for s in scored}["a"] == pytest.approx(0.2)
    scored, _ = score_candidates(hits, lambda h: 5, rule="interim")
    assert {s.memory_id: s.kind for s in scored} == {"a": "interim", "b": "interim"}


def test_a_bad_component_is_an_invalid_score_decision() -> None:
    scored, rejected = score_candidates([_hit("a", 0.9, 0.8, (0.9, 1.5, 0.5, 0.8, 0.1))], lambda h: 5)
    assert not scored and rejected[0].decision == "invalid_score" and "components.recency" in rejected[0].reason


def test_parse_hits_takes_components_and_refuses_broken_ones() -> None:
    base = {"memory_id": "m1", "content": "c", "category": "fact", "similarity": 0.5, "confidence": 0.5, "rank": 1}
    good = {**base, "components": dict.fromkeys(COMPONENTS, 0.5), "salience": 0.7}
    bad = {**base, "memory_id": "m2", "components": {"relevance": 0.5}}
    hits, rejects = parse_hits(json.dumps({"memories": [good, bad]}).encode(), "hot", 20)
    assert hits[0].components == (0.5,) * 5 and hits[0].salience == 0.7
    assert rejects[0].memory_id == "m2" and "components must be" in rejects[0].reason


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


def test_request_weights_travel_on_the_wire() -> None:
    w = {"relevance": 1.0, "recency": 0.0, "usefulness": 0.0, "confidence": 0.0, "access": 0.0}
    req = AssembleRequest.model_validate({"request_id": "r", "org_id": "o", "agent_id": "a", "model": "gpt-4o",
                                          "query": "q", "deadline_ns": 1, "options": {"weights": w}})
    again = AssembleRequest.model_validate_json(req.model_dump_json())
    assert again.options.weights is not None and again.options.weights.as_tuple() == (1.0, 0.0, 0.0, 0.0, 0.0)


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


def test_rejected_candidates_keep_their_components() -> None:
    comps = (0.2, 0.1, 0.1, 0.1, 0.1)
    scored, rejected = score_candidates([_hit("low", 0.2, 0.1, comps), _hit("dup", 0.9, 0.9, (0.9,) * 5, "hot"),
                                         _hit("dup", 0.5, 0.5, (0.5,) * 5)], lambda h: 5, min_score=0.5)
    by = {(r.memory_id, r.decision): r for r in rejected}
    assert by[("low", "below_floor")].components == comps and "composite score" in by[("low", "below_floor")].reason
    assert by[("dup", "duplicate")].components == (0.5,) * 5
    assert [s.memory_id for s in scored] == ["dup"]


class _Counting:
    """The real hashing embedder, counting the query embeddings it is asked for."""

    def __init__(self) -> None:
        from ibex_context.memory.embed import HashingEmbedder

        self.inner = HashingEmbedder()
        self.name, self.dim, self.blocking = self.inner.name, self.inner.dim, True
        self.queries: list[str] = []

    def embed(self, texts: Any) -> Any:
        return self.inner.embed(texts)

    def embed_query(self, text: str) -> Any:
        self.queries.append(text)
        return self.inner.embed_query(text)


async def test_a_query_is_embedded_once_per_org_even_when_its_first_caller_goes_away() -> None:
    import asyncio

    from ibex_context.memory.config import MemoryConfig
    from ibex_context.memory.service import MemoryService

    emb = _Counting()
    svc = MemoryService(MemoryConfig(), emb, enable_faults=False, clock=lambda: 0.0)  # type: ignore[arg-type]
    first = asyncio.ensure_future(svc.query_vector("acme", "where is my invoice"))
    second = asyncio.ensure_future(svc.query_vector("acme", "where is my invoice"))
    await asyncio.sleep(0)
    first.cancel()  # the hot call timed out; the search waiting on the same text still gets it
    vec = await second
    assert np.allclose(vec, emb.inner.embed_query("where is my invoice"))
    assert await svc.query_vector("acme", "where is my invoice") is vec  # cached
    await svc.query_vector("globex", "where is my invoice")  # another org: its own embedding
    assert emb.queries == ["where is my invoice", "where is my invoice"]


def test_a_search_without_a_cutoff_gets_the_embedders_own(memory: MemoryServiceHandle) -> None:
    """The cutoff belongs to the embedder (cosine scales differ): minilm's is 0.20, hash's the
    spec's 0.70; a search naming ``min_similarity`` gets exactly that (docs/selection-quality.md)."""
    from ibex_context.memory.embed import HashingEmbedder
    from ibex_context.memory.minilm import MiniLMEmbedder
    from ibex_context.memory.static import StaticEmbedder
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
