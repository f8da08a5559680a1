"""Frozen values passed between the pure pipeline stages (retrieve -> score -> pack -> format)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from ibex_context.shared.models import IDENT_CHARS

Source = Literal["hot", "cold"]
PackPath = Literal["dp", "greedy", "all_fit", "empty"]
RejectKind = Literal["invalid_score", "duplicate", "below_floor", "over_cap", "over_limit", "malformed"]

# The memory-hit contract: a memory_id is an identifier like the wire's org and agent ids.
_MEMORY_ID: Final = re.compile(IDENT_CHARS)


def memory_id_problem(memory_id: object) -> str | None:
    """Why ``memory_id`` breaks the memory-hit contract, or None when it is a valid identifier.

    An empty or odd id cannot name a memory in decisions, caches or the rendered block, so the hit
    is refused as ``malformed`` (README "Scoring and packing") rather than packed under it.
    """
    if not isinstance(memory_id, str):
        return f"memory_id must be a string, got {type(memory_id).__name__}"
    if _MEMORY_ID.fullmatch(memory_id) is None:
        return f"memory_id {memory_id[:80]!r} must be 1-64 characters of [A-Za-z0-9_.-]"
    return None


@dataclass(frozen=True, slots=True)
class MemoryHit:
    """One memory as the memory service returned it (untrusted text, scores not yet checked)."""

    memory_id: str
    content: str
    category: str
    similarity: float
    confidence: float
    rank: int
    source: Source


@dataclass(frozen=True, slots=True)
class ScoredMemory:
    """A candidate with its token cost and the packer's score.

    ``composite_score`` is the INTERIM score 0.85 x similarity + 0.15 x confidence (spec:
    "Context packer score"). It is named for formatter/proto alignment; it is NOT the memory
    service's five-part composite.
    """

    hit: MemoryHit
    tokens: int
    composite_score: float

    @property
    def memory_id(self) -> str:
        return self.hit.memory_id


@dataclass(frozen=True, slots=True)
class Rejection:
    """A candidate dropped before packing, with the reason a person can read."""

    memory_id: str
    source: Source
    decision: RejectKind
    reason: str
    tokens: int | None = None
    score: float | None = None


@dataclass(frozen=True, slots=True)
class PackResult:
    """What the packer chose. ``packed`` is in emitted order: score desc, then memory_id."""

    packed: tuple[ScoredMemory, ...]
    excluded: tuple[ScoredMemory, ...]  # left out for budget, in score order
    path: PackPath
    evaluated: int
    excluded_for_budget: int
    budget_reached: bool
    total_tokens: int
    total_score: float
    token_budget: int
