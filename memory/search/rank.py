"""The memory-service composite ranking (spec: ranking-and-packing.md, "Memory-service composite").

Pure functions, no I/O, no clock: ``now_s`` is always passed in.

Order of operations for search, and why each step sits where it does:

1. Retrieval-time cosine cutoff (``min_similarity``; the spec's 0.70, or the embedder's own when a
   search names none: ``Embedder.min_similarity``): a vector candidate below it that matched no
   query word is dropped (``memory.search.fusion``).
2. Full-text and vector scores are fused into one relevance (``memory.search.fusion``, docs/memory-search.md "Memory
   search").
3. Scoring-time relevance floor (default 0.15), before the composite. A floor at or above 0.5
   could exclude memories found by their words alone, so it is refused.
4. Composite = 0.40 relevance + 0.25 recency + 0.20 usefulness + 0.10 confidence + 0.05 access
   frequency; recency halves every category-specific half-life. Ties break on ``memory_id``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True, slots=True)
class Weights:
    relevance: float = 0.40
    recency: float = 0.25
    usefulness: float = 0.20
    confidence: float = 0.10
    access: float = 0.05

    def total(self) -> float:
        return self.relevance + self.recency + self.usefulness + self.confidence + self.access


WEIGHTS = Weights()

# Days until a memory's recency score halves. Preferences and facts age slowly; events and
# tasks are mostly useful while they are fresh.
HALF_LIFE_DAYS: Mapping[str, float] = MappingProxyType(
    {
        "fact": 365.0,
        "preference": 180.0,
        "relationship": 180.0,
        "skill": 120.0,
        "note": 30.0,
        "event": 14.0,
        "task": 7.0,
    }
)
CATEGORIES = frozenset(HALF_LIFE_DAYS)
DEFAULT_HALF_LIFE_DAYS = 30.0

DEFAULT_RELEVANCE_FLOOR = 0.15
# The spec's bound: a floor at or above 0.5 would drop memories that match most of the question's
# words but not its meaning (memory.search.fusion: their relevance is TEXT_WEIGHT x text, from 0.4 up).
FLOOR_LIMIT = 0.5
ACCESS_SATURATION = 100  # this many accesses (or more) scores 1.0 on access frequency
_DAY_S = 86_400.0


def check_relevance_floor(floor: float) -> float:
    """Validate the scoring-time floor: finite, in [0, 0.5). Raises ``ValueError`` otherwise."""
    if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not math.isfinite(floor):
        raise ValueError(f"relevance floor must be a finite number, got {floor!r}")
    if floor < 0.0:
        raise ValueError(f"relevance floor must be >= 0, got {floor}")
    if floor >= FLOOR_LIMIT:
        raise ValueError(
            f"relevance floor {floor} refused: values at or above {FLOOR_LIMIT} could exclude memories found by "
            f"the question's words alone (full-text hits); use < {FLOOR_LIMIT}"
        )
    return float(floor)


def half_life_days(category: str) -> float:
    return HALF_LIFE_DAYS.get(category, DEFAULT_HALF_LIFE_DAYS)


def access_score(access_count: int) -> float:
    """Log-scaled access frequency in [0, 1]: the first accesses matter most."""
    if access_count <= 0:
        return 0.0
    return min(1.0, math.log1p(access_count) / math.log1p(ACCESS_SATURATION))


def cosine_scores(matrix: NDArray[np.float32], query: NDArray[np.float32]) -> NDArray[np.float32]:
    """Cosine of each (unit) row with the (unit) query; zero rows and queries score 0."""
    if matrix.size == 0:
        return np.zeros(matrix.shape[0], dtype=np.float32)
    return np.asarray(matrix @ query, dtype=np.float32)


# ------------------------------------------------------------------ vectorised retrieval, hot relevance

HOT_SALIENCE_SHARE = 0.2  # the part of a hot memory's relevance that comes from its salience


def hot_relevance(cosine: float, salience: float) -> float:
    """A hot memory's relevance to the question: 0.8 x cosine (clipped to [0, 1]) + 0.2 x salience.

    Hot memories pass no retrieval cutoff (they are the agent's standing context), so they are
    ranked for the question by their cosine like any other hit; the salience share keeps a very
    salient memory above noise when nothing matches, and can never lift it above a memory whose
    cosine is higher by more than a quarter of the salience gap.
    """
    cos = min(max(cosine, 0.0), 1.0) if math.isfinite(cosine) else 0.0
    return (1.0 - HOT_SALIENCE_SHARE) * cos + HOT_SALIENCE_SHARE * min(max(salience, 0.0), 1.0)


def rank_arrays(
    memory_ids: Sequence[str], relevance: Sequence[float], features: Sequence[tuple[float, float, float, float, float]],
    *, now_s: float, relevance_floor: float = DEFAULT_RELEVANCE_FLOOR, limit: int, weights: Weights = WEIGHTS,
) -> tuple[list[int], list[float], list[float]]:
    """Apply the relevance floor, score the composite, sort (score desc, memory_id) and cut, with
    array operations: (positions, composites, recencies) of the kept hits, best first.
    ``features[i]`` is ``record_features`` of the i-th hit.

    Recency is 0.5 ** (age / half-life), 1.0 for a memory from "now" (or the future: clock skew),
    0 for a non-finite age. The tests hold this equal to a scalar reference of the same
    floating-point operations in the same order, one candidate at a time.
    """
    floor = check_relevance_floor(relevance_floor)
    n = len(memory_ids)
    if n == 0 or limit <= 0:
        return [], [], []
    f = np.fromiter(chain.from_iterable(features), dtype=np.float64, count=5 * n).reshape(n, 5)
    rel = np.asarray(relevance, dtype=np.float64)
    created, half_life_s, usefulness, confidence, access = f.T
    with np.errstate(invalid="ignore", over="ignore"):
        age = now_s - created
        ok = np.isfinite(rel) & np.isfinite(usefulness) & np.isfinite(confidence) & np.isfinite(created)
        ok &= rel >= floor
        recency = np.where(np.isfinite(age), 0.5 ** (np.maximum(age, 0.0) / half_life_s), 0.0)
        score = (weights.relevance * rel + weights.recency * recency + weights.usefulness * usefulness
                 + weights.confidence * confidence + weights.access * access)
    at = np.flatnonzero(ok)
    at = at[order_of([memory_ids[i] for i in at.tolist()], score[at])[:limit]]
    return at.tolist(), score[at].tolist(), recency[at].tolist()


def order_of(ids: Sequence[str], scores: NDArray[np.float64]) -> NDArray[np.intp]:
    """Positions of ``ids`` by ``scores``, best first, ties by memory id: what ``sorted`` by
    ``(-score, id)`` gives, as one ``lexsort`` (no key tuple per candidate)."""
    by_id = sorted(range(len(ids)), key=ids.__getitem__)
    rank = np.empty(len(ids), dtype=np.intp)
    rank[by_id] = np.arange(len(ids))
    return np.lexsort((rank, -scores))


def record_features(created_at_s: float, category: str, usefulness: float, confidence: float,
                    access_count: int) -> tuple[float, float, float, float, float]:
    """What ``rank_arrays`` needs of one memory that does not depend on the query or the clock."""
    return (created_at_s, half_life_days(category) * _DAY_S, usefulness, confidence, access_score(access_count))
