"""Late-interaction rerank: the fused candidates reordered by MaxSim over MiniLM token states.

A pooled vector keeps one point per text; a question of twelve words and a turn that answers
three of them can sit far apart. ColBERT's late interaction compares every question token with
every memory token instead: a memory's MaxSim is the mean, over the question's token states, of
the best cosine with any of the memory's (``maxsim``). The states come from the embedder's own
forward pass (the question's when it is embedded, a memory's when it is written:
``memory.token_states``), so the rerank costs no extra pass, only one small matrix product.

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
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from ibex_context.memory.fusion import Fused
from ibex_context.memory.token_states import DIMS, Array, decode

RERANK_WEIGHT = 0.6  # ``a`` above (docs/memory-search.md "Late-interaction rerank")
RERANK_DEPTH = 50  # candidates reranked


def maxsim(query: Array, docs: Sequence[Array]) -> list[float]:
    """Each doc's MaxSim with ``query`` (unit rows ``[tokens, DIMS]`` each; docs non-empty): one
    product over all of the docs' rows, then the best per doc with ``maximum.reduceat``."""
    if not docs or query.shape[0] == 0:
        return [0.0] * len(docs)
    rows = np.concatenate(docs)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    best = np.maximum.reduceat(query @ rows.T, starts, axis=1)
    return [float(x) for x in best.mean(axis=0)]


def _z(values: NDArray[np.float64]) -> NDArray[np.float64] | None:
    sd = float(values.std())
    return None if sd < 1e-9 else (values - values.mean()) / sd


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
    decoded = {m: decode(states.get(m)) for m in top}
    rated = [m for m in top if decoded[m] is not None]
    if len(rated) < 2:
        return out
    sims = maxsim(query_states, [d for m in rated if (d := decoded[m]) is not None])
    rel = np.array([fused[m].relevance for m in top], dtype=np.float64)
    z_rel, z_sim = _z(rel), _z(np.asarray(sims, dtype=np.float64))
    at = {m: i for i, m in enumerate(top)}
    for j, (m, sim) in enumerate(zip(rated, sims, strict=True)):
        f = fused[m]
        r = f.relevance
        if z_rel is not None and z_sim is not None:
            mixed = (1.0 - weight) * z_rel[at[m]] + weight * z_sim[j]
            r = min(max(float(rel.mean() + rel.std() * mixed), 0.0), 1.0)
            if f.relevance >= floor:
                r = max(r, floor)
        out[m] = replace(f, relevance=r, rerank=min(max(sim, 0.0), 1.0))
    return out
