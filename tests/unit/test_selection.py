"""Selection quality: hybrid retrieval, hot ranked for the question, the composite
and its components on the wire, the packer's weighted score and per-request weights, explain.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_selection.py.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from ibex_context.memory.search.rank import HOT_SALIENCE_SHARE, hot_relevance
from ibex_context.pipeline.selection.score import DEFAULT_WEIGHTS, score_candidates
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import COMPONENTS, AssembleRequest, AssemblyOptions, ScoreWeights
from ibex_context.worker.retrieve import parse_hits


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


def test_request_weights_travel_on_the_wire() -> None:
    w = {"relevance": 1.0, "recency": 0.0, "usefulness": 0.0, "confidence": 0.0, "access": 0.0}
    req = AssembleRequest.model_validate({"request_id": "r", "org_id": "o", "agent_id": "a", "model": "gpt-4o",
                                          "query": "q", "deadline_ns": 1, "options": {"weights": w}})
    again = AssembleRequest.model_validate_json(req.model_dump_json())
    assert again.options.weights is not None and again.options.weights.as_tuple() == (1.0, 0.0, 0.0, 0.0, 0.0)


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
        from ibex_context.memory.embedders.embed import HashingEmbedder

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

    from ibex_context.memory.service.config import MemoryConfig
    from ibex_context.memory.service.state import MemoryService

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
