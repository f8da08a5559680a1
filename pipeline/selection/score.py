"""Scoring stage: checks each hit's numbers and gives it the packer's score.

docs/selection-quality.md: a hit that carries the memory composite's five components
(relevance, recency, usefulness, confidence, access; the reference memory service sends them) is
scored by their weighted sum, with the request's ``AssemblyOptions.weights`` or the packer's
defaults ``DEFAULT_WEIGHTS`` (0.70, 0.10, 0.10, 0.05, 0.05)::

    composite = sum(w_i x component_i)

A hit without them (another memory service), or every hit when ``options.score`` is "interim",
gets the labelled INTERIM score (docs/assembly.md "Scoring and packing")::

    interim = 0.85 x similarity + 0.15 x confidence

The result is stored as ``ScoredMemory.composite_score`` (``kind`` says which score it is). Every
input must be finite and in [0, 1]; anything else is reported
as a ``Rejection`` with a readable reason, never clamped and never raised, because one bad hit
must not sink the whole assembly (decode failures are values, not crashes). This stage also
gives every distinct memory exactly one decision: bad ids are ``malformed`` and repeated ids keep
one copy, the others being ``duplicate`` (``score_candidates``).

Pure: no I/O, no clocks, no module state beyond constants.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ...shared.wire.models import COMPONENTS, ScoreWeights
from ..types import MemoryHit, Rejection, ScoredMemory
from .hits import MEMORY_ID, memory_id_problem

# (similarity weight, confidence weight) of the interim score; docs/assembly.md "Scoring and packing".
INTERIM_WEIGHTS: Final[tuple[float, float]] = (0.85, 0.15)
Weights5 = tuple[float, float, float, float, float]
# The packer's default weights (docs/selection-quality.md): relevance first. The memory service
# ranks its candidates with the spec's (0.40, 0.25, 0.20, 0.10, 0.05); packing with those put
# fresh, much-used but unrelated memories first (bench.retrieval, minilm at cutoff 0.30: MRR 0.48
# against 0.72 with these, recall@10 0.79 against 0.89). Defined once: ScoreWeights' defaults.
DEFAULT_WEIGHTS: Final[Weights5] = ScoreWeights().as_tuple()
_ID_MATCH: Final = MEMORY_ID.fullmatch


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


def composite_score(components: Sequence[float], weights: Weights5) -> float:
    """The weighted sum of already-checked components (weights sum to 1; min() for rounding)."""
    if len(components) != len(weights):
        raise ValueError(f"{len(components)} components for {len(weights)} weights")
    return min(1.0, math.fsum(map(operator.mul, weights, components)))


def _unit_float(v: object) -> bool:
    """The common case of a sound number, answered at once: a float in [0, 1] (NaN fails)."""
    return type(v) is float and 0.0 <= v <= 1.0


def _copy_problem(hit: MemoryHit, use_components: bool) -> str | None:
    """Why this copy's numbers cannot be scored, or None."""
    s, c = hit.similarity, hit.confidence
    problems: list[str] = []
    if not (_unit_float(s) and _unit_float(c)):
        problems = [p for p in (_unit_problem("similarity", s), _unit_problem("confidence", c)) if p is not None]
    comps = hit.components
    if use_components and comps is not None and not all(map(_unit_float, comps)):
        problems += [p for name, v in zip(COMPONENTS, comps, strict=True)
                     if (p := _unit_problem(f"components.{name}", v)) is not None]
    return "; ".join(problems) or None


def _score(hit: MemoryHit, use_components: bool, weights: Weights5) -> tuple[float, str]:
    if use_components and hit.components is not None:
        return composite_score(hit.components, weights), "composite"
    return interim_score(hit.similarity, hit.confidence), "interim"


def _duplicate_reason(kept: MemoryHit, kept_at: int, kept_score: float | None, drop: MemoryHit,
                      drop_score: float | None, kind: str = "interim") -> str:
    """Which copy of a repeated memory_id was kept, and why (docs/assembly.md "Scoring and packing")."""
    if kept_score is None:
        why = "no copy has valid scores; the hot copy, then the first returned, is the one reported"
    elif drop_score is None:
        why = "this copy's scores are invalid"
    elif kept_score > drop_score:
        why = f"its {kind} score {kept_score:.4f} beats this copy's {drop_score:.4f}"
    elif kept.source != drop.source:
        why = f"same {kind} score {kept_score:.4f}; the hot copy is preferred"
    else:
        why = f"same {kind} score {kept_score:.4f}; the copy returned first is kept"
    return f"duplicate memory_id: the copy {kept.source} #{kept_at} (rank {kept.rank}) was kept ({why})"


def _choose_copies(
    hits: Sequence[MemoryHit], at: Sequence[int], scores: Sequence[float | None], kinds: Sequence[str] | None = None,
) -> tuple[list[bool], list[Rejection]]:
    """One copy per memory_id: valid scores first, then the higher interim score, then hot, then
    the first returned. Returns which indices are kept and a ``duplicate`` for every other copy
    (``at``: each hit's position in its source's list, to name the kept copy)."""
    best: dict[str, int] = {}
    for i, hit in enumerate(hits):
        j = best.get(hit.memory_id)
        if j is None or _copy_key(hit, scores[i]) > _copy_key(hits[j], scores[j]):
            best[hit.memory_id] = i
    keep = [best[h.memory_id] == i for i, h in enumerate(hits)]
    rejects = []
    for i, h in enumerate(hits):
        if not keep[i]:
            k = best[h.memory_id]
            reason = _duplicate_reason(hits[k], at[k], scores[k], h, scores[i], kinds[k] if kinds else "interim")
            comps = h.components if kinds and kinds[i] == "composite" else None
            rejects.append(Rejection(h.memory_id, h.source, "duplicate", reason, score=scores[i], components=comps))
    return keep, rejects


def _copy_key(hit: MemoryHit, score: float | None) -> tuple[bool, float, bool]:
    # Strictly greater wins, so among equal keys the first copy returned stays.
    return score is not None, score if score is not None else 0.0, hit.source == "hot"


def score_candidates(
    hits: Sequence[MemoryHit],
    cost: Callable[[MemoryHit], int],
    *,
    min_score: float = 0.0,
    weights: Weights5 | None = None,
    rule: str = "composite",
) -> tuple[list[ScoredMemory], list[Rejection]]:
    """Score every hit; return (scored in input order, rejections).

    Exactly one decision per distinct memory: a hit whose ``memory_id`` breaks the memory-hit
    contract (``pipeline.selection.hits.memory_id_problem``) is ``malformed`` under a placeholder id
    ``<source#n>`` (n counts that source's hits here); of several copies of one memory_id (hot and
    cold, or twice in one branch) one is kept, valid scores first, then the higher interim score,
    then hot, then the first returned, and every other copy is a ``duplicate`` naming the kept copy
    and why. The kept copy then gets its own decision, so a duplicate never hides a valid copy
    behind an invalid one.

    ``cost`` is the hit's token cost as the formatter will spend it (its per-memory block cost,
    markup included), so the packer's ``total_tokens <= token_budget`` holds after formatting
    (docs/assembly.md "Budget and token counting"). It is called only for kept hits whose scores are valid
    and at or above ``min_score``; a cost that raises, is not an int, or is negative rejects that
    hit as ``invalid_score`` (the wire has no separate kind for a bad cost) with the cause in
    ``reason``.

    ``min_score`` is the caller's floor (``AssemblyOptions.min_score``); a score strictly below it
    is ``below_floor``. An invalid ``min_score`` is a programming error and raises ``ValueError``.

    ``weights`` (the request's, already validated) weight the components of hits that carry them
    (default ``DEFAULT_WEIGHTS``); ``rule`` "interim" ignores components altogether.
    """
    floor_problem = _unit_problem("min_score", min_score)
    if floor_problem is not None:
        raise ValueError(floor_problem)
    named = _name_hits(hits)
    use = rule == "composite"
    problems, scores, kinds = _rate(named.hits, use, weights or DEFAULT_WEIGHTS)
    ids = [h.memory_id for h in named.hits]
    keep, duplicates = ([True] * len(ids), []) if len(set(ids)) == len(ids) \
        else _choose_copies(named.hits, named.at, scores, kinds)
    rejected = [*named.malformed, *duplicates]
    scored: list[ScoredMemory] = []
    for hit, problem, score, kind, kept in zip(named.hits, problems, scores, kinds, keep, strict=True):
        if not kept:
            continue
        out = _score_kept(hit, problem, score, cost, min_score, kind)
        if isinstance(out, ScoredMemory):
            scored.append(out)
        else:
            rejected.append(out)
    return scored, rejected


def _rate(hits: Sequence[MemoryHit], use: bool, w: Weights5) -> tuple[list[str | None], list[float | None], list[str]]:
    """Each copy's problem, score and score kind (``use``: components count when a hit carries them)."""
    w_sim, w_conf = INTERIM_WEIGHTS
    problems: list[str | None] = []
    scores: list[float | None] = []
    kinds: list[str] = []
    for hit in hits:
        s, c = hit.similarity, hit.confidence
        if (not use or hit.components is None) and type(s) is float and type(c) is float \
                and 0.0 <= s <= 1.0 and 0.0 <= c <= 1.0:  # the common case, as _copy_problem and interim_score
            problems.append(None)
            scores.append(min(1.0, w_sim * s + w_conf * c))
            kinds.append("interim")
            continue
        problem = _copy_problem(hit, use)
        score, kind = (None, "interim") if problem else _score(hit, use, w)
        problems.append(problem)
        scores.append(score)
        kinds.append(kind)
    return problems, scores, kinds


@dataclass(frozen=True, slots=True)
class _Named:
    """Hits with a valid memory_id, each one's position in its source's list, and the others."""

    hits: list[MemoryHit]
    at: list[int]
    malformed: list[Rejection]


def _name_hits(hits: Sequence[MemoryHit]) -> _Named:
    """Split off the hits whose memory_id breaks the contract, as ``malformed`` under ``<source#n>``."""
    named = _Named([], [], [])
    seen: dict[str, int] = {}
    for hit in hits:
        source, mid = hit.source, hit.memory_id
        n = seen[source] = seen.get(source, -1) + 1
        # a plain str of the alphabet at once; anything else is memory_id_problem's to answer
        if (type(mid) is str and _ID_MATCH(mid) is not None) or (problem := memory_id_problem(mid)) is None:
            named.hits.append(hit)
            named.at.append(n)
        else:
            named.malformed.append(Rejection(f"<{source}#{n}>", source, "malformed", problem))
    return named


def _score_kept(hit: MemoryHit, problem: str | None, score: float | None, cost: Callable[[MemoryHit], int],
                min_score: float, kind: str) -> ScoredMemory | Rejection:
    """The kept copy's own decision: invalid scores, below the floor, a bad cost, or scored."""
    if problem is not None or score is None:
        return Rejection(hit.memory_id, hit.source, "invalid_score", problem or "no score")
    if score < min_score:
        reason = f"{kind} score {score:.4f} is below min_score {min_score:.4f}"
        return Rejection(hit.memory_id, hit.source, "below_floor", reason, score=score,
                         components=hit.components if kind == "composite" else None)
    try:
        tokens = cost(hit)
    except Exception as exc:  # a failing cost function rejects this hit only
        reason = f"token cost failed: {type(exc).__name__}: {exc}"
        return Rejection(hit.memory_id, hit.source, "invalid_score", reason, score=score)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        reason = f"token cost must be a non-negative int, got {type(tokens).__name__} {tokens!r}"
        return Rejection(hit.memory_id, hit.source, "invalid_score", reason, score=score)
    return ScoredMemory(hit, tokens, score, kind)  # positional: a third cheaper for a frozen dataclass
