"""Decisions: one answer per candidate to "where did my memory go?" (docs/assembly.md "Scoring and packing").

Pure: built from what the scorer rejected, what the packer packed or left out, and what the
formatter dropped.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from ..shared.wire.models import COMPONENTS
from .types import Rejection, RetrievalResult, ScoredMemory

# A Decision's fields: the response validates every row in one pass (``pipeline.assemble.response``),
# a third cheaper than a model per candidate, and the models it builds are the same.
DecisionFields = dict[str, Any]


def decisions(
    retrieval: RetrievalResult, rejected: list[Rejection], kept: list[ScoredMemory],
    excluded: list[ScoredMemory], dropped: list[ScoredMemory], usable: int,
) -> list[DecisionFields]:
    """One decision per distinct memory_id, plus a ``duplicate`` for every other copy of it.

    The scorer already keeps one copy per id. A copy retrieval refused (malformed or over its
    branch cap) under an id that also has a scored copy is reported as a ``duplicate`` that names
    what happened to the scored copy, so an id never gets two contradictory answers.
    """
    rows = [_rejected(r) for r in rejected]
    # the guards answer the usual interim hit without a search's scores before any call
    rows += [{"memory_id": m.hit.memory_id, "source": m.hit.source, "decision": "packed",
              "reason": f"packed: {m.tokens} tokens, {m.kind} score {m.composite_score:.4f}",
              "tokens": m.tokens, "score": m.composite_score,
              "components": components_of(m) if m.kind == "composite" else None,
              "retrieval": retrieval_scores(m) if m.hit.text_score is not None else None} for m in kept]
    if excluded:
        packing = _Packing(sum(m.tokens for m in kept), math.fsum(m.composite_score for m in kept),
                           sorted(m.composite_score for m in kept), usable)
        rows += [_excluded(m, _budget_reason(m, packing)) for m in excluded]
    rows += [_excluded(m, (f"packed, then dropped: the rendered memories section counted more tokens than "
                           f"its per-memory estimate, and at score {m.composite_score:.4f} this was the "
                           f"lowest-scored memory")) for m in dropped]
    if not retrieval.rejections:
        return rows
    answered = {d["memory_id"]: d for d in rows if d["decision"] != "duplicate"}
    early: list[DecisionFields] = []
    for r in retrieval.rejections:
        first = answered.get(r.memory_id)
        if first is not None and r.decision == "below_cutoff":
            continue  # under the search's line, but the memory came in by another branch: answered there
        if first is None:
            answered[r.memory_id] = d = _rejected(r)
        else:
            d = {"memory_id": r.memory_id, "source": r.source, "decision": "duplicate",
                 "reason": (f"duplicate memory_id: the {first['source']} copy was kept ({first['decision']}); "
                            f"this copy was {r.decision}: {r.reason}")}
        early.append(d)
    return [*early, *rows]


def _rejected(r: Rejection) -> DecisionFields:
    return {"memory_id": r.memory_id, "source": r.source, "decision": r.decision, "reason": r.reason,
            "tokens": r.tokens, "score": _unit(r.score),
            "components": None if r.components is None else dict(zip(COMPONENTS, r.components, strict=True)),
            "retrieval": r.retrieval}


def components_of(m: ScoredMemory) -> dict[str, float] | None:
    """The five components the score was built from (None for an interim score)."""
    c = m.hit.components
    if m.kind != "composite" or c is None:
        return None
    return dict(zip(COMPONENTS, c, strict=True))


def retrieval_scores(m: ScoredMemory) -> dict[str, float] | None:
    """A search hit's stage scores (full text, vector, subject boost, rerank), when the memory service sent them."""
    h = m.hit
    if h.text_score is None or h.vector_score is None:
        return None
    out = {"text": h.text_score, "vector": h.vector_score}
    if h.boost is not None:
        out["boost"] = h.boost
    if h.rerank_score is not None:
        out["rerank"] = h.rerank_score
    return out


def _excluded(m: ScoredMemory, reason: str) -> DecisionFields:
    return {"memory_id": m.memory_id, "source": m.hit.source, "decision": "excluded_budget", "reason": reason,
            "tokens": m.tokens, "score": m.composite_score, "components": components_of(m),
            "retrieval": retrieval_scores(m)}


@dataclass(frozen=True, slots=True)
class _Packing:
    """What was packed, summarised once for the budget reasons."""

    tokens: int
    total_score: float
    scores: list[float]  # ascending
    usable: int


def _budget_reason(m: ScoredMemory, p: _Packing) -> str:
    """Why a memory was left out for budget, saying only what is true of this packing.

    A memory larger than the whole budget was never in competition with anything; otherwise it
    lost to the packed set, whose members need not each score higher (the packer maximises the
    total score, docs/assembly.md "Scoring and packing").
    """
    if m.tokens > p.usable or p.usable <= 0:
        return f"needs {m.tokens} tokens, budget is {p.usable}"
    left = p.usable - p.tokens
    short = m.tokens - left
    if short <= 0:  # the packer refills whatever fits; said plainly should that ever change
        return f"needs {m.tokens} tokens and {left} of {p.usable} were left, but the packer did not take it"
    lower = bisect.bisect_left(p.scores, m.composite_score)  # packed memories scoring below this one
    head = f"needs {m.tokens} tokens but only {left} of {p.usable} were left"
    if lower == 0:
        return f"{head} after {len(p.scores)} memories scoring at least as high (short by {short})"
    return (f"{head} after {len(p.scores)} packed memories, total score {p.total_score:.4f} (short by {short}); "
            f"{lower} of them score lower: the packer maximises the total score, not each memory's")


def _unit(v: float | None) -> float | None:
    """Scores echoed in decisions must be valid numbers; an invalid one is described in the reason."""
    if v is None or not (0.0 <= v <= 1.0):
        return None
    return v

