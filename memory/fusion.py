"""Hybrid ranking: how a memory's full-text score and its vector score become one relevance
(README "Memory search"). Pure: no I/O, no clock.

A search asks the engine for the best full-text matches (BM25) and the nearest vectors of the
agent's memories; every candidate of either list gets both scores (the cosine is computed for a
text-only candidate, and a vector-only candidate's text score is 0: it matched no query word).

    text  = bm25 / max(bm25 of this query's candidates)          in [0, 1]
    relevance = TEXT_WEIGHT x text + (1 - TEXT_WEIGHT) x cosine  (cosine clipped to [0, 1])

The text side is scaled by the query's best match only (not min-max), so a memory that matches
no word scores 0 on it, whatever the spread; the cosine is kept as it is, so a question with no
answer keeps low relevance instead of having its best guess stretched to 1. Retrieval keeps a
candidate that matched a query word, or whose cosine reaches the embedder's cutoff
(``min_similarity``); the relevance floor (``rank``) applies after.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TEXT_WEIGHT = 0.4  # measured on bench/data/conversations.jsonl: README "Memory search"


@dataclass(frozen=True, slots=True)
class Fused:
    """One candidate's scores: the fused relevance and the two it came from."""

    relevance: float
    text: float  # BM25 scaled by the query's best, in [0, 1]
    vector: float  # cosine with the question, clipped to [0, 1]


def _unit(x: float) -> float:
    return min(max(x, 0.0), 1.0) if math.isfinite(x) else 0.0


def fuse(bm25: Mapping[str, float], cosine: Mapping[str, float], *, min_similarity: float,
         text_weight: float = TEXT_WEIGHT) -> dict[str, Fused]:
    """memory_id -> ``Fused`` for every candidate retrieval keeps.

    ``bm25``: the text query's candidates and their scores (> 0); ``cosine``: the cosine of every
    candidate of either list (a candidate missing here has no vector and scores 0 on that side).
    """
    best = max((s for s in bm25.values() if math.isfinite(s)), default=0.0)
    out: dict[str, Fused] = {}
    for mid in bm25.keys() | cosine.keys():
        raw = bm25.get(mid, 0.0)
        matched = math.isfinite(raw) and raw > 0.0
        text = _unit(raw / best) if matched and best > 0.0 else 0.0
        vec = _unit(cosine.get(mid, 0.0))
        if not matched and vec < min_similarity:
            continue
        out[mid] = Fused(text_weight * text + (1.0 - text_weight) * vec, text, vec)
    return out
