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
from .fusion import Fused

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


def _stored_rows(top: Sequence[str], states: Mapping[str, object]) -> tuple[list[str], Array, list[int]] | None:
    """The memories of ``top`` with usable token states, all their rows in one matrix, and each
    one's row count; ``None`` when fewer than two have any. Decoded in one conversion; one at a
    time only when that meets a damaged scale."""
    counts = {m: n for m in top if (n := rows_of(states.get(m)))}
    rated = list(counts)
    if len(rated) < 2:
        return None
    rows = decode_many([cast(bytes, states[m]) for m in rated], [counts[m] for m in rated])
    if rows is None:
        each = {m: decode(states[m]) for m in rated}
        rated = [m for m in rated if each[m] is not None]
        if len(rated) < 2:
            return None
        rows = np.concatenate([cast(Array, each[m]) for m in rated])
    return rated, rows, [counts[m] for m in rated]


def rerank(fused: Mapping[str, Fused], query_states: Array | None, states: Mapping[str, object], *,
           weight: float, depth: int = RERANK_DEPTH, floor: float = 0.0) -> dict[str, Fused]:
    """``fused`` with its ``depth`` best candidates' relevance mixed with their MaxSim (module
    docstring); ``states`` maps a memory id to its stored token states (bytes, any may be missing
    or damaged). Unchanged when ``weight`` is 0, the question has no states, or fewer than two of
    the candidates have usable ones."""
    out = dict(fused)
    if weight <= 0.0 or query_states is None or query_states.shape[0] == 0 or query_states.shape[1] != DIMS:
        return out
    top = sorted(fused, key=lambda m: (-fused[m].relevance, m))[:depth]
    got = _stored_rows(top, states)
    if got is None:
        return out
    rated, rows, counts = got
    sim_array = _maxsims(query_states, rows, counts)
    sims = np.clip(sim_array, 0.0, 1.0).tolist()  # the stage score shown
    rel = np.array([fused[m].relevance for m in top], dtype=np.float64)
    z_rel, z_sim = _z(rel), _z(sim_array.astype(np.float64))
    if z_rel is None or z_sim is None:  # nothing to standardise: the order stays, the scores are shown
        mixed = [fused[m].relevance for m in rated]
    else:
        if len(rated) < len(top):  # rated keeps top's order
            at = {m: i for i, m in enumerate(top)}
            z_rel = z_rel[[at[m] for m in rated]]
        mixed = np.clip(rel.mean() + rel.std() * ((1.0 - weight) * z_rel + weight * z_sim), 0.0, 1.0).tolist()
    for m, sim, r in zip(rated, sims, mixed, strict=True):
        f = fused[m]
        out[m] = Fused(max(r, floor) if f.relevance >= floor else r, f.text, f.vector, f.boost, sim)
    return out


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
