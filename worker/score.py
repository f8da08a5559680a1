"""Scoring stage: checks each hit's numbers and gives it the packer's interim score.

Spec, ranking-and-packing.md "Context packer score": the context service sees only
``similarity``, ``confidence`` and ``rank`` from the memory service, so until memory exposes its
five-part composite on the wire the packer ranks by a labelled INTERIM score::

    interim = 0.85 x similarity + 0.15 x confidence

The result is stored as ``ScoredMemory.composite_score`` for formatter/proto alignment; it is NOT
the memory-service composite. Both inputs must be finite and in [0, 1]; anything else is reported
as a ``Rejection`` with a readable reason, never clamped and never raised, because one bad hit
must not sink the whole assembly (STYLE: decode failures are values, not crashes).

Pure: no I/O, no clocks, no module state beyond constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final

from worker.types import MemoryHit, Rejection, ScoredMemory

# (similarity weight, confidence weight) of the interim score; spec "Context packer score".
# Per-request AssemblyOptions weights are a forward contract and deliberately not applied here.
INTERIM_WEIGHTS: Final[tuple[float, float]] = (0.85, 0.15)


def _unit_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not a finite number in [0, 1], or None when it is.

    ``bool`` is an ``int`` subclass in Python but never a score, so it is refused explicitly.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} must be a number in [0, 1], got {type(value).__name__} {value!r}"
    if not math.isfinite(value):
        return f"{name} must be finite, got {value!r}"
    if not 0.0 <= value <= 1.0:
        return f"{name} must be in [0, 1], got {value!r}"
    return None


def interim_score(similarity: float, confidence: float) -> float:
    """The spec's interim score for already-checked inputs (both finite, in [0, 1])."""
    w_sim, w_conf = INTERIM_WEIGHTS
    # min(): the weights sum to 1, so only float rounding could nudge a result past 1.0.
    return min(1.0, w_sim * float(similarity) + w_conf * float(confidence))


def score_candidates(
    hits: Sequence[MemoryHit],
    cost: Callable[[MemoryHit], int],
    *,
    min_score: float = 0.0,
) -> tuple[list[ScoredMemory], list[Rejection]]:
    """Score every hit; return (scored in input order, rejections in input order).

    ``cost`` is the hit's token cost as the formatter will spend it (its per-memory block cost,
    markup included), so the packer's ``total_tokens <= token_budget`` holds after formatting
    (spec "Budget calculation"). It is called only for hits whose scores are valid and at or above
    ``min_score``; a cost that raises, is not an int, or is negative rejects that hit as
    ``invalid_score`` (the wire has no separate kind for a bad cost) with the cause in ``reason``.

    ``min_score`` is the caller's floor (``AssemblyOptions.min_score``); a score strictly below it
    is ``below_floor``. An invalid ``min_score`` is a programming error and raises ``ValueError``.
    """
    floor_problem = _unit_problem("min_score", min_score)
    if floor_problem is not None:
        raise ValueError(floor_problem)

    scored: list[ScoredMemory] = []
    rejected: list[Rejection] = []
    for hit in hits:
        problems = [
            p
            for p in (_unit_problem("similarity", hit.similarity), _unit_problem("confidence", hit.confidence))
            if p is not None
        ]
        if problems:
            rejected.append(Rejection(hit.memory_id, hit.source, "invalid_score", "; ".join(problems)))
            continue

        score = interim_score(hit.similarity, hit.confidence)
        if score < min_score:
            reason = f"interim score {score:.4f} is below min_score {min_score:.4f}"
            rejected.append(Rejection(hit.memory_id, hit.source, "below_floor", reason, score=score))
            continue

        try:
            tokens = cost(hit)
        except Exception as exc:  # a failing cost function rejects this hit only
            reason = f"token cost failed: {type(exc).__name__}: {exc}"
            rejected.append(Rejection(hit.memory_id, hit.source, "invalid_score", reason, score=score))
            continue
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            reason = f"token cost must be a non-negative int, got {type(tokens).__name__} {tokens!r}"
            rejected.append(Rejection(hit.memory_id, hit.source, "invalid_score", reason, score=score))
            continue

        scored.append(ScoredMemory(hit=hit, tokens=tokens, composite_score=score))
    return scored, rejected
