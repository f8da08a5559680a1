"""Hybrid ranking: how a memory's full-text match and its vector score become one relevance
(docs/memory-search.md). Pure: no I/O, no clock.

The full-text side asks the engine, per content word of the question, for the agent's memories
holding it with their BM25 scores, and how many memories hold it (the word's document frequency).
A memory's text score is the share of the question's information it matches:

    text(m) = sum over words w of idf(w) x bm25_w(m) / max bm25_w    /  sum over words of idf(w)

so a memory that best matches every word scores 1, one that matches only a word most memories
hold scores little, and a question word no memory holds lowers every text score (the question
asks for something the memories may not have). ``idf`` is Okapi's, over the agent's memories.

    relevance = cosine + TEXT_WEIGHT x text x (1 - cosine)          (cosine clipped to [0, 1])

The text side lifts a memory toward 1 by the share of the question it matches and never lowers
one: a memory found by meaning alone keeps its cosine, so search hits stay on the cosine scale of
hot hits and of other memory services, and a question worded unlike its answer loses nothing to
word matches elsewhere (measured against a convex mix and reciprocal rank fusion: docs/memory-search.md "Memory
search").

That rule (``lift``, the default) is one of three ``IBEX_MEMORY_FUSION`` selects, so the others
can be measured on the same stack (docs/memory-search.md):

    convex:  relevance = (1 - w) x cosine + w x text                 (w = TEXT_WEIGHT setting)
    rrf:     relevance = ((1 - w) / (60 + rank_cosine) + w / (60 + rank_text)) x 61
             (reciprocal rank fusion over the candidates, k = 60, scaled so rank 1 in both is 1)
    zscore:  relevance = logistic(w x z(text) + (1 - w) x z(cosine))
             (each side standardised over the search's candidates: a side whose scores spread
             little moves the order little, whatever its scale)

After the rule, a memory about a person the question names (``memory.search.subjects``) is lifted by
``boost``: relevance + boost x (1 - relevance), so the boost never takes a memory past 1.

Retrieval keeps a candidate that matched a question word, or whose cosine reaches the embedder's
cutoff (``min_similarity``), whatever the rule; the relevance floor (``rank``) applies after.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

TEXT_WEIGHT = 0.8  # measured on the conversation and demo sets: docs/memory-search.md
SUBJECT_BOOST = 0.3  # measured on the conversation set: docs/memory-search.md
RRF_K = 60  # reciprocal rank fusion's constant (Cormack, Clarke and Buettcher, 2009)
FusionRule = Literal["lift", "convex", "rrf", "zscore"]
Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Fused:
    """One candidate's scores: the fused relevance and the two it came from."""

    relevance: float
    text: float  # the share of the question's words matched, weighted by IDF and BM25, in [0, 1]
    vector: float  # cosine with the question, clipped to [0, 1]
    boost: float = 0.0  # the subject boost this candidate got (``boosted``)
    rerank: float | None = None  # its MaxSim with the question, when reranked (``memory.search.rerank``)


def idf(df: int, n_docs: int) -> float:
    """Okapi BM25's inverse document frequency (never negative)."""
    df = min(max(df, 0), max(n_docs, 0))
    return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))


def text_scores(per_word: Sequence[Mapping[str, float]], dfs: Sequence[int], n_docs: int,
                bests: Sequence[float] | None = None) -> dict[str, float]:
    """memory_id -> text score in (0, 1] for every memory that matched a word (see the module).

    ``per_word[i]``: the memories holding the i-th word and their BM25 for it; ``dfs[i]``: how many
    of the agent's ``n_docs`` memories hold it; ``bests[i]``, when positive, the word's best BM25
    over all of them (a common word scores only some: ``memory.search.terms``), else the best here.
    """
    weights = [idf(df, n_docs) for df in dfs]
    total = math.fsum(weights)
    out: dict[str, float] = {}
    if total <= 0.0:
        return out
    inf = math.inf
    for i, (w, scores) in enumerate(zip(weights, per_word, strict=True)):
        best = max((s for s in scores.values() if 0.0 < s < inf), default=0.0)  # finite and positive
        if bests is not None and math.isfinite(bests[i]) and bests[i] > 0.0:
            best = bests[i]
        if best <= 0.0:
            continue
        get = out.get
        for mid, s in scores.items():
            if 0.0 < s < inf:
                share = s / best
                out[mid] = get(mid, 0.0) + w * (1.0 if share > 1.0 else share) / total
    return {m: min(v, 1.0) for m, v in out.items() if v > 0.0}


@dataclass(frozen=True, slots=True)
class Pool:
    """A search's kept candidates as arrays aligned with ``ids``: each stage of the search reads and
    writes them all at once instead of one ``Fused`` per candidate (``fused`` makes one)."""

    ids: list[str]
    relevance: Floats
    text: Floats
    vector: Floats
    boost: Floats
    rerank: Floats  # NaN where the candidate was not reranked

    def fused(self, i: int) -> Fused:
        """The ``i``-th candidate's scores as one ``Fused``."""
        sim = float(self.rerank[i])
        return Fused(float(self.relevance[i]), float(self.text[i]), float(self.vector[i]), float(self.boost[i]),
                     None if math.isnan(sim) else sim)

    def as_dict(self) -> dict[str, Fused]:
        return {m: self.fused(i) for i, m in enumerate(self.ids)}

    def with_relevance(self, relevance: Floats, rerank: Floats | None = None) -> Pool:
        return Pool(self.ids, relevance, self.text, self.vector, self.boost, self.rerank if rerank is None else rerank)


def fuse_pool(ids: Sequence[str], text: Floats, cosine: Floats, *, min_similarity: float,
              text_weight: float = TEXT_WEIGHT, rule: FusionRule = "lift") -> tuple[Pool, NDArray[np.bool_]]:
    """The candidates retrieval keeps, fused by ``rule`` (see the module), and which of ``ids`` they
    are (a mask). ``text[i]``: the i-th candidate's text score (0: it matched no question word);
    ``cosine[i]``: its cosine (0: it has no vector)."""
    with np.errstate(invalid="ignore"):
        vec = np.where(np.isfinite(cosine), np.clip(cosine, 0.0, 1.0), 0.0)  # clipped to [0, 1]
        matched = np.isfinite(text) & (text > 0.0)
        kept = matched | (vec >= min_similarity)
    t = np.where(matched, np.minimum(text, 1.0), 0.0)[kept]
    v = vec[kept]
    at = np.flatnonzero(kept).tolist()
    kept_ids = [ids[i] for i in at]
    if rule == "rrf" or rule == "zscore":
        pairs = {m: (a, b) for m, a, b in zip(kept_ids, t.tolist(), v.tolist(), strict=True)}
        got = _rrf(pairs, text_weight) if rule == "rrf" else _zscore(pairs, text_weight)
        rel = np.array([got[m].relevance for m in kept_ids], dtype=np.float64)
    elif rule == "convex":
        rel = (1.0 - text_weight) * v + text_weight * t
    else:
        rel = v + text_weight * t * (1.0 - v)
    nothing = np.zeros(len(kept_ids))
    return Pool(kept_ids, rel, t, v, nothing, np.full(len(kept_ids), np.nan)), kept


def fuse(text: Mapping[str, float], cosine: Mapping[str, float], *, min_similarity: float,
         text_weight: float = TEXT_WEIGHT, rule: FusionRule = "lift") -> dict[str, Fused]:
    """memory_id -> ``Fused`` for every candidate retrieval keeps, by ``rule`` (see the module):
    ``fuse_pool`` over named candidates.

    ``text``: the candidates that matched a question word and their text scores (``text_scores``);
    ``cosine``: the cosine of every candidate of either side (a candidate missing here has no
    vector and scores 0 on that side).
    """
    ids = list(text.keys() | cosine.keys())
    pool, _ = fuse_pool(ids, np.array([text.get(m, 0.0) for m in ids], dtype=np.float64),
                        np.array([cosine.get(m, 0.0) for m in ids], dtype=np.float64),
                        min_similarity=min_similarity, text_weight=text_weight, rule=rule)
    return pool.as_dict()


def _rrf(kept: Mapping[str, tuple[float, float]], text_weight: float) -> dict[str, Fused]:
    """Reciprocal rank fusion of the kept candidates' two orders (ties broken by memory_id); a
    candidate absent from one side (text score or cosine 0) gets nothing from that side."""
    def ranks(side: int) -> dict[str, int]:
        order = sorted((m for m, s in kept.items() if s[side] > 0.0), key=lambda m: (-kept[m][side], m))
        return {m: i + 1 for i, m in enumerate(order)}
    by_text, by_vec = ranks(0), ranks(1)
    out: dict[str, Fused] = {}
    for mid, (t, v) in kept.items():
        score = (text_weight / (RRF_K + by_text[mid]) if mid in by_text else 0.0) + (
            (1.0 - text_weight) / (RRF_K + by_vec[mid]) if mid in by_vec else 0.0)
        out[mid] = Fused(min(score * (RRF_K + 1), 1.0), t, v)
    return out


def _standard(values: Sequence[float]) -> list[float]:
    """Each value's distance from the mean in standard deviations (all 0 when they do not spread)."""
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    return [0.0] * n if sd <= 1e-12 else [(v - mean) / sd for v in values]


def _zscore(kept: Mapping[str, tuple[float, float]], text_weight: float) -> dict[str, Fused]:
    """z-score fusion of the kept candidates (see the module), squashed into (0, 1) by the logistic."""
    if not kept:
        return {}
    ids = list(kept)
    zt = _standard([kept[m][0] for m in ids])
    zv = _standard([kept[m][1] for m in ids])
    out: dict[str, Fused] = {}
    for mid, a, b in zip(ids, zt, zv, strict=True):
        t, v = kept[mid]
        out[mid] = Fused(1.0 / (1.0 + math.exp(-(text_weight * a + (1.0 - text_weight) * b))), t, v)
    return out


def boost_pool(pool: Pool, about: NDArray[np.bool_], boost: float) -> Pool:
    """``pool`` with every candidate ``about`` marks (a memory about a person the question names)
    lifted by ``boost`` toward 1 (see the module); the others as they were."""
    if boost <= 0.0 or not about.any():
        return pool
    rel = pool.relevance
    return Pool(pool.ids, np.where(about, rel + boost * (1.0 - rel), rel), pool.text, pool.vector,
                np.where(about, boost, pool.boost), pool.rerank)


def boosted(fused: Mapping[str, Fused], about: Mapping[str, bool], boost: float) -> dict[str, Fused]:
    """``fused`` with every candidate ``about`` marks (a memory about a person the question names)
    lifted by ``boost`` toward 1 (see the module); the others as they were."""
    if boost <= 0.0 or not any(about.values()):
        return dict(fused)
    return {m: (Fused(f.relevance + boost * (1.0 - f.relevance), f.text, f.vector, boost) if about.get(m) else f)
            for m, f in fused.items()}
