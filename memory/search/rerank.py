"""Late-interaction rerank: the fused candidates reordered by MaxSim over MiniLM token states.

A pooled vector keeps one point per text; a question of twelve words and a turn that answers
three of them can sit far apart. ColBERT's late interaction compares every question token with
every memory token instead: a memory's MaxSim is the mean, over the question's token states, of
the best cosine with any of the memory's (``maxsim``). The states come from the embedder's own
forward pass (the question's when it is embedded, a memory's when it is written:
``memory.embedders.token_states``), so the rerank costs no extra pass, only one small matrix product.

``rerank`` moves the ``depth`` best candidates by relevance (after fusion and the subject boost):
each one's relevance ``r`` becomes ``mean(r) + sd(r) · ((1 − a)·z(r) + a·z(maxsim))``, the two
standardised over those candidates, ``a`` = ``IBEX_MEMORY_RERANK_WEIGHT``. The relevance stays
on its own scale (so the composite, the floor and the worker's scoring read it as before), and
``a`` 0 leaves it unchanged. A memory without usable token states (written before they were
stored, by another embedder, or damaged) keeps its relevance, and the rerank never takes a
candidate under the relevance floor it was above. Each reranked candidate's MaxSim is its
``rerank`` stage score (``explain`` shows it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
from numpy.typing import NDArray

from ..embedders.token_states import DIMS, Array, decode, decode_many, rows_of
from .fusion import Fused, Pool
from .rank import order_of

RERANK_WEIGHT = 0.6  # ``a`` above (docs/memory-search.md "Late-interaction rerank")
RERANK_DEPTH = 200  # candidates reranked
RERANK_DEPTH_MAX = 1000  # the largest IBEX_MEMORY_RERANK_DEPTH accepted
RERANK_MIN_CANDIDATES = 0  # candidates the rerank compares at least (``widened``); 0: only those kept


def maxsim(query: Array, rows: Array, counts: Sequence[int]) -> list[float]:
    """Each doc's MaxSim with ``query`` (unit rows ``[tokens, DIMS]``): ``rows`` holds every doc's
    rows in order, ``counts[i]`` (at least 1) of them the i-th doc's. One product over all of them,
    then each doc's best per query token with ``maximum.reduceat``."""
    if not counts or query.shape[0] == 0:
        return [0.0] * len(counts)
    sims: list[float] = _maxsims(query, rows, counts).tolist()
    return sims


def _maxsims(query: Array, rows: Array, counts: Sequence[int]) -> NDArray[np.float32]:
    """``maxsim`` as an array (``counts`` and the query not empty)."""
    starts = np.cumsum([0, *counts[:-1]])
    best: NDArray[np.float32] = np.maximum.reduceat(query @ rows.T, starts, axis=1).mean(axis=0)
    return best


def _z(values: NDArray[np.float64]) -> NDArray[np.float64] | None:
    sd = float(values.std())
    return None if sd < 1e-9 else (values - values.mean()) / sd


def _stored_rows(top: Sequence[str], states: Mapping[str, object]) -> tuple[list[int], Array, list[int]] | None:
    """The positions in ``top`` of the memories with usable token states, all their rows in one
    matrix, and each one's row count; ``None`` when fewer than two have any. Decoded in one
    conversion; one at a time only when that meets a damaged scale."""
    got = [states.get(m) for m in top]
    counts_all = [rows_of(raw) for raw in got]
    rated = [i for i, n in enumerate(counts_all) if n]
    if len(rated) < 2:
        return None
    raws = [cast(bytes, got[i]) for i in rated]
    counts = [counts_all[i] for i in rated]
    rows = decode_many(raws, counts)
    if rows is None:
        each = [decode(raw) for raw in raws]
        keep = [k for k, e in enumerate(each) if e is not None]
        if len(keep) < 2:
            return None
        rated, counts = [rated[k] for k in keep], [counts[k] for k in keep]
        rows = np.concatenate([cast(Array, each[k]) for k in keep])
    return rated, rows, counts


def rerank_pool(pool: Pool, query_states: Array | None, states: Mapping[str, object], *,
                weight: float, depth: int = RERANK_DEPTH, floor: float = 0.0) -> Pool:
    """``pool`` with its ``depth`` best candidates' relevance mixed with their MaxSim (module
    docstring); ``states`` maps a memory id to its stored token states (bytes, any may be missing
    or damaged). Unchanged when ``weight`` is 0, the question has no states, or fewer than two of
    the candidates have usable ones."""
    if weight <= 0.0 or query_states is None or query_states.shape[0] == 0 or query_states.shape[1] != DIMS:
        return pool
    top = order_of(pool.ids, pool.relevance)[:depth]
    ids = pool.ids
    got = _stored_rows([ids[i] for i in top.tolist()], states)
    if got is None:
        return pool
    rated, rows, counts = got
    at = top[rated]  # the rated candidates' positions in the pool, in top's order
    sim_array = _maxsims(query_states, rows, counts)
    rel = pool.relevance[top]
    z_rel, z_sim = _z(rel), _z(sim_array.astype(np.float64))
    old = pool.relevance[at]
    if z_rel is None or z_sim is None:  # nothing to standardise: the order stays, the scores are shown
        mixed = old
    else:
        if len(rated) < len(top):
            z_rel = z_rel[rated]
        mixed = np.clip(rel.mean() + rel.std() * ((1.0 - weight) * z_rel + weight * z_sim), 0.0, 1.0)
        mixed = np.where(old >= floor, np.maximum(mixed, floor), mixed)
    relevance, sims = pool.relevance.copy(), pool.rerank.copy()
    relevance[at] = mixed
    sims[at] = np.clip(sim_array, 0.0, 1.0)  # the stage score shown
    return pool.with_relevance(relevance, sims)


def rerank(fused: Mapping[str, Fused], query_states: Array | None, states: Mapping[str, object], *,
           weight: float, depth: int = RERANK_DEPTH, floor: float = 0.0) -> dict[str, Fused]:
    """``rerank_pool`` over named candidates: ``fused`` with its ``depth`` best candidates'
    relevance mixed with their MaxSim, each reranked one carrying its MaxSim."""
    ids = list(fused)
    fs = [fused[m] for m in ids]
    pool = Pool(ids, np.array([f.relevance for f in fs]), np.array([f.text for f in fs]),
                np.array([f.vector for f in fs]), np.array([f.boost for f in fs]),
                np.array([np.nan if f.rerank is None else f.rerank for f in fs], dtype=np.float64))
    return rerank_pool(pool, query_states, states, weight=weight, depth=depth, floor=floor).as_dict()


def widened(kept: Mapping[str, Fused], under: Sequence[tuple[float, str]], want: int) -> dict[str, Fused]:
    """The candidates under the cosine cutoff that join the rerank: when fewer than ``want`` were
    kept, the most similar of ``under`` ((cosine, memory id), most similar first) until ``want``,
    each at its cosine (the relevance of a memory that holds no question word). ``stays`` decides
    after the rerank which of them are kept."""
    room = max(want - len(kept), 0)
    return {m: Fused(min(max(c, 0.0), 1.0), 0.0, min(max(c, 0.0), 1.0)) for c, m in under[:room]}


def stays(reranked: Mapping[str, Fused], joined: Mapping[str, Fused], cutoff: float) -> dict[str, Fused]:
    """``reranked`` without the candidates that joined from under the cosine cutoff (``widened``) and
    whose reranked relevance is still under it: a memory that holds no question word is kept when
    its relevance reaches the cutoff, by its cosine or by the rerank."""
    return {m: f for m, f in reranked.items() if m not in joined or f.relevance >= cutoff}


def joined_pool(pool: Pool, under: Sequence[tuple[float, str]], want: int) -> Pool:
    """``widened`` over a ``Pool``: ``pool`` and, when it holds fewer than ``want``, the most similar
    of ``under`` ((cosine, memory id), most similar first) until ``want``, each at its cosine;
    ``stays_pool`` decides after the rerank which of them are kept."""
    room = max(want - len(pool.ids), 0)
    if not room or not under:
        return pool
    c = np.clip(np.array([c for c, _ in under[:room]], dtype=np.float64), 0.0, 1.0)
    n = len(c)
    return Pool(pool.ids + [m for _, m in under[:room]], np.concatenate([pool.relevance, c]),
                np.concatenate([pool.text, np.zeros(n)]), np.concatenate([pool.vector, c]),
                np.concatenate([pool.boost, np.zeros(n)]), np.concatenate([pool.rerank, np.full(n, np.nan)]))


def stays_pool(pool: Pool, kept: int, cutoff: float) -> Pool:
    """``stays`` over a ``Pool``: ``pool`` without the candidates past its first ``kept`` (those that
    joined from under the cosine cutoff: ``joined_pool``) whose reranked relevance is still under it."""
    keep = np.ones(len(pool.ids), dtype=np.bool_)
    keep[kept:] = pool.relevance[kept:] >= cutoff
    if keep.all():
        return pool
    at = np.flatnonzero(keep)
    return Pool([pool.ids[i] for i in at.tolist()], pool.relevance[at], pool.text[at], pool.vector[at],
                pool.boost[at], pool.rerank[at])
