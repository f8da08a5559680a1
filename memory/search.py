"""Search and hot ranking of the memory service (the handlers in ``memory.app`` call these).

Search (spec "Memory-service composite"): the query is embedded once (``MemoryService.query_vector``),
every row of the agent's cached index is scored with array operations (one matrix-vector product
for the cosines, one array add per query term for the full-text match), the retrieval cutoff and
the sentinel pick at most ``max_candidates`` rows, and only those are hydrated and ranked by the
five-part composite. No Python loop runs over the agent's memories.

Hot with a query: the hot list (the ``limit`` most salient) is ranked for the question instead of
by salience alone: each hit's relevance is ``rank.hot_relevance`` (cosine with the question and
salience) and the list is ordered by the composite, as search results are. Every hit carries
``relevance``, ``composite`` and its ``components``; hot hits also carry ``salience``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response

from ibex_context.memory import reads, store
from ibex_context.memory.embed import Vectors, content_terms
from ibex_context.memory.models import MemoryRecord, SearchBody
from ibex_context.memory.rank import (
    cosine_scores,
    hot_relevance,
    keyword_mask,
    rank_arrays,
    record_features,
    select_rows,
)
from ibex_context.memory.service import MemoryService

_query_terms = lru_cache(maxsize=4096)(content_terms)  # repeated questions are normalised once


@store.per_record
def _features(rec: MemoryRecord) -> tuple[tuple[float, float, float, float, float], float]:
    """The record's ``rank.record_features`` and its access score as the wire shows it."""
    f = record_features(rec.created_at.timestamp(), rec.category, rec.usefulness, rec.confidence, rec.access_count)
    return f, round(f[4], 6)


def _ranked(svc: MemoryService, where: str, recs: Sequence[MemoryRecord], relevance: Sequence[float], *,
            salience: Sequence[float] | None, floor: float, limit: int) -> Response:
    """Rank ``recs`` by the composite (``rank.rank_arrays``) and answer with each hit's relevance,
    composite and components; hot hits (``salience`` given) also carry their salience, which is
    their ``similarity``; a search hit's similarity is its relevance."""
    kept, scores, recencies = rank_arrays([r.memory_id for r in recs], relevance, [_features(r)[0] for r in recs],
                                          now_s=svc.clock(), relevance_floor=floor, limit=limit)
    found: list[tuple[MemoryRecord, float]] = []
    extras: list[dict[str, Any]] = []
    for i, score, recency in zip(kept, scores, recencies, strict=True):
        rec, rel = recs[i], round(relevance[i], 6)
        doc: dict[str, Any] = {"relevance": rel, "composite": round(score, 6), "components": {
            "relevance": rel, "recency": round(recency, 6), "usefulness": rec.usefulness,
            "confidence": rec.confidence, "access": _features(rec)[1]}}
        if salience is not None:
            doc["salience"] = salience[i]
        found.append((rec, relevance[i] if salience is None else salience[i]))
        extras.append(doc)
    return svc.answer(found, where, extras)


async def _relevance(svc: MemoryService, org: str, index: store.SearchIndex, text: str,
                     body: SearchBody) -> dict[str, float]:
    """Retrieval over the whole index with array operations: memory_id -> relevance."""
    if not index.ids:
        return {}
    query_vec = await svc.query_vector(org, text)
    cosines = cosine_scores(index.matrix, query_vec)
    keyword = keyword_mask(index.postings, len(index.ids), _query_terms(text))
    cutoff = svc.embedder.min_similarity if body.min_similarity is None else body.min_similarity
    rows, relevance = select_rows(index.id_array, cosines, keyword, min_similarity=cutoff,
                                  max_candidates=svc.config.max_candidates)
    return {index.ids[r]: float(v) for r, v in zip(rows.tolist(), relevance.tolist(), strict=True)}


async def search(svc: MemoryService, org: str, body: SearchBody) -> Response:
    """Rank the agent's memories for the query. With a cached index this is one Redis round trip
    (``reads.records_if_current``); after a write, the index is rebuilt first."""
    embedder, agent = svc.embedder, body.agent_id
    text = svc.query_text(body.query)
    cached = svc.index_cache.peek((org, agent, embedder.name))
    records: dict[str, MemoryRecord] | None = None
    if cached is not None:
        rel_of = await _relevance(svc, org, cached[1], text, body)
        if len(rel_of) <= reads.MAX_SCRIPT_IDS:
            records = await reads.records_if_current(svc.scripts, org, agent, sorted(rel_of), cached[0], svc.health)
    if records is None:
        index = await store.load_index(svc.redis, org, agent, embedder_name=embedder.name, dim=embedder.dim,
                                       embed=svc.embed, cache=svc.index_cache, health=svc.health)
        rel_of = await _relevance(svc, org, index, text, body)
        records = await store.hydrate(svc.redis, org, agent, sorted(rel_of), svc.health)
    if not records:
        return JSONResponse({"memories": []})
    recs = list(records.values())
    return _ranked(svc, f"{org}/{agent}", recs, [rel_of[r.memory_id] for r in recs], salience=None,
                   floor=svc.config.relevance_floor, limit=body.limit)


async def rank_hot(svc: MemoryService, org: str, agent: str, found: list[tuple[MemoryRecord, float]],
                   vectors: dict[str, Vectors], query: str) -> Response:
    """The hot list ordered by composite with each hit's relevance to ``query`` (``vectors``: the
    stored ones, read with the list by ``reads.hot_with_vectors``; missing ones are embedded)."""
    text = svc.query_text(query)
    ids = [rec.memory_id for rec, _ in found]
    missing = [rec for rec, _ in found if rec.memory_id not in vectors]
    if missing:  # written by hand or by another embedder: embed now (a search would backfill them)
        for rec, vec in zip(missing, await svc.embed([r.content for r in missing]), strict=True):
            vectors[rec.memory_id] = vec
    query_vec = await svc.query_vector(org, text)
    cosines = cosine_scores(np.stack([vectors[i] for i in ids]), query_vec) if ids else np.zeros(0)
    relevance = [hot_relevance(float(c), s) for (_, s), c in zip(found, cosines.tolist(), strict=True)]
    return _ranked(svc, f"{org}/{agent}", [rec for rec, _ in found], relevance, salience=[s for _, s in found],
                   floor=0.0, limit=len(found))
