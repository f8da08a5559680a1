"""Frozen values passed between the pure stages (retrieval result -> score -> pack -> format).

The vocabularies (``Source``, ``PackPath``, ``RejectKind``) are the wire's, defined once in
``shared.wire.models``; these dataclasses only carry them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..shared.wire.models import (
    BranchName,
    BranchOutcome,
    ChatFormat,
    PackPath,
    RejectKind,
    Source,
    SummarySlot,
)


@dataclass(frozen=True, slots=True)
class MemoryHit:
    """One memory as the memory service returned it (untrusted text, scores not yet checked).

    Built only through ``pipeline.selection.hits`` from wire data, so the shape is already checked; the
    scores are checked by the scorer, which reports a bad one as a decision (docs/assembly.md "Scoring and
    packing").
    """

    memory_id: str
    content: str
    category: str
    similarity: float
    confidence: float
    rank: int
    source: Source
    # The memory composite's five inputs (relevance, recency, usefulness, confidence, access: the
    # order of ``shared.wire.models.COMPONENTS``) when the service sent them; unchecked until the scorer.
    components: tuple[float, float, float, float, float] | None = None
    salience: float | None = None  # hot hits: the stored salience
    date: str | None = None  # the memory's creation day, YYYY-MM-DD (rendered with it)
    text_score: float | None = None  # search hits: the full-text and vector scores their relevance
    vector_score: float | None = None  # was fused from (shown by explain)
    boost: float | None = None  # search hits: the subject boost their relevance got
    rerank_score: float | None = None  # search hits: their late-interaction MaxSim, when reranked


@dataclass(frozen=True, slots=True)
class ScoredMemory:
    """A candidate with its token cost and the packer's score.

    ``composite_score`` is the packer's score (docs/selection-quality.md): the weighted composite
    of the hit's five components when it carries them (``kind`` "composite"), else the INTERIM
    score 0.85 x similarity + 0.15 x confidence (``kind`` "interim").
    """

    hit: MemoryHit
    tokens: int
    composite_score: float
    kind: str = "interim"  # which score composite_score is: "composite" or "interim"

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
    components: tuple[float, float, float, float, float] | None = None  # when the score was built from them
    retrieval: dict[str, float] | None = None  # below-cutoff candidates: their stage scores


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


@dataclass(frozen=True, slots=True)
class RetrievalResult:
    """What retrieval handed the pipeline: the directive, each branch's kept hits, the hits it
    refused (malformed or over a branch cap), every branch's outcome and the stored summary.

    Copies of one memory_id in ``hot`` and ``cold`` both stay here: the scorer picks the copy
    (docs/assembly.md "Scoring and packing").
    """

    directive: str | None
    hot: tuple[MemoryHit, ...]
    cold: tuple[MemoryHit, ...]
    rejections: tuple[Rejection, ...]
    outcomes: dict[BranchName, BranchOutcome]
    summary: SummarySlot | None = None  # the one stored under the request's summary_key, decoded

    @property
    def degraded_reasons(self) -> list[str]:
        return [
            f"{name} {o.status}" + (f": {o.error_class}" if o.error_class else "")
            for name, o in self.outcomes.items()
            if o.status in ("timeout", "error")
        ]


Target = Literal["text", "openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class Turns:
    """A request's conversation in the one form the pipeline works on (``pipeline.rendering.turns`` makes it).

    ``messages`` and ``tools`` are plain dicts in the provider's shape (the simple form's
    ``recent_messages`` are OpenAI-shaped ``{"role", "content"}`` messages and its
    ``tool_schemas`` its tools); ``format`` says how its history splits into units,
    ``target`` which renderer emits it, ``field`` what a refusal names.
    """

    format: ChatFormat
    target: Target
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    system: Any = None
    field: str = "messages"
