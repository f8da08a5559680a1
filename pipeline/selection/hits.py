"""The memory-hit contract, written once: what a hit from the memory service must look like.

One object of the memory service's ``{"memories": [...]}`` answer (docs/deploy.md "Backing services") is
a hit when it has every field of ``HIT_FIELDS`` with these limits, the same ones the memory
service stores memories under (docs/security.md "Degradation and security": a write cannot break reads):

* ``memory_id``: an identifier, ``[A-Za-z0-9_.-]{1,64}`` (the wire's ``IDENT_CHARS``);
* ``content``: a string of at most ``MAX_CONTENT_CHARS`` characters;
* ``category``: a string of at most ``MAX_CATEGORY_CHARS`` characters;
* ``similarity`` and ``confidence``: numbers (not booleans). Whether they are finite and in
  [0, 1] is the scorer's to say, as an ``invalid_score`` decision with a reason (docs/assembly.md "Scoring
  and packing"): one bad score must cost that memory only, and show up as such;
* ``rank``: an integer >= 0 (the service numbers from 1; 0 is accepted so hand-written
  ``explain`` inputs stay valid);
* optional: ``components``, an object of the composite's five numbers (``COMPONENTS``), which
  the packer's score is built from (docs/selection-quality.md), ``salience`` (hot hits),
  ``text_score``, ``vector_score``, ``boost`` and ``rerank_score`` (search hits: what the relevance
  was fused from, and the late-interaction MaxSim that reordered it), and
  ``created_at`` (a string; its leading ``YYYY-MM-DD``, when it has one, is rendered as the
  memory's date, so "when" questions can be answered from the prompt).

The worker's retriever refuses a hit that breaks the contract as ``malformed``; ``ops explain``
refuses its input file; both build ``MemoryHit`` only through ``to_hit`` (or ``plain_hit``, the
same contract checked and built in one pass for a hit in the JSON parser's own types).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from ...shared.wire.models import COMPONENTS, IDENT_CHARS, BranchOutcome, Source
from ..types import MemoryHit, Rejection, RetrievalResult

HIT_FIELDS: Final = ("memory_id", "content", "category", "similarity", "confidence", "rank")
MAX_CONTENT_CHARS: Final = 64_000  # the memory service's limit on a stored memory
MAX_CATEGORY_CHARS: Final = 64
MEMORY_ID: Final = re.compile(IDENT_CHARS)  # fullmatch: a valid memory_id
_FIELD_SET: Final = frozenset(HIT_FIELDS)
_COMPONENT_SET: Final = frozenset(COMPONENTS)


def _is_mapping(v: object) -> bool:
    return type(v) is dict or isinstance(v, Mapping)  # the JSON parser's dicts skip the ABC check


def memory_id_problem(memory_id: object) -> str | None:
    """Why ``memory_id`` breaks the memory-hit contract, or None when it is a valid identifier.

    An empty or odd id cannot name a memory in decisions, caches or the rendered block, so the hit
    is refused as ``malformed`` (docs/assembly.md "Scoring and packing") rather than packed under it.
    """
    if not isinstance(memory_id, str):
        return f"memory_id must be a string, got {type(memory_id).__name__}"
    if MEMORY_ID.fullmatch(memory_id) is None:
        return f"memory_id {memory_id[:80]!r} must be 1-64 characters of [A-Za-z0-9_.-]"
    return None


def _is_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float)


def shape_problem(raw: object) -> str | None:
    """Why ``raw`` is not a hit, the memory_id's alphabet aside; None when every field is sound.

    The alphabet is left to ``memory_id_problem`` because ``explain`` lets the scorer report a bad
    id as a ``malformed`` decision, where the retriever refuses it at once.
    """
    if not _is_mapping(raw):
        return "not an object"
    assert isinstance(raw, Mapping)
    if not _FIELD_SET <= raw.keys():
        return f"missing {', '.join(f for f in HIT_FIELDS if f not in raw)}"
    if not isinstance(raw["memory_id"], str):
        return memory_id_problem(raw["memory_id"])
    if not isinstance(raw["content"], str):
        return "content must be a string"
    if len(raw["content"]) > MAX_CONTENT_CHARS:
        return f"content must be at most {MAX_CONTENT_CHARS} characters, got {len(raw['content'])}"
    cat = raw["category"]
    if not isinstance(cat, str) or len(cat) > MAX_CATEGORY_CHARS:
        return f"category must be a string of at most {MAX_CATEGORY_CHARS} characters"
    for key in ("similarity", "confidence"):
        if not _is_number(raw[key]):
            return f"{key} must be a number"
    rank = raw["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return "rank must be an integer >= 0"
    return _optional_problem(raw)


def _optional_problem(raw: Mapping[str, Any]) -> str | None:
    """The optional ``components`` (an object of the five numbers) and ``salience`` (a number)."""
    comps = raw.get("components")
    if comps is not None and (not _is_mapping(comps) or comps.keys() != _COMPONENT_SET
                              or not all(_is_number(comps[k]) for k in COMPONENTS)):
        return f"components must be an object of five numbers: {', '.join(COMPONENTS)}"
    for key in ("salience", "text_score", "vector_score", "boost", "rerank_score"):
        if raw.get(key) is not None and not _is_number(raw[key]):
            return f"{key} must be a number"
    if raw.get("created_at") is not None and not isinstance(raw["created_at"], str):
        return "created_at must be a string"
    return None


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def hit_date(created_at: object) -> str | None:
    """The ``YYYY-MM-DD`` a ``created_at`` string starts with, or None (no date is then rendered)."""
    if not isinstance(created_at, str):
        return None
    m = _DATE.match(created_at)
    return m.group() if m is not None else None


def hit_problem(raw: object) -> str | None:
    """Why ``raw`` breaks the whole contract (its id first), or None."""
    if _is_mapping(raw) and "memory_id" in raw:  # type: ignore[operator]
        id_problem = memory_id_problem(raw["memory_id"])  # type: ignore[index]
        if id_problem is not None:
            return id_problem
    return shape_problem(raw)


def _plain_number(v: object) -> bool:
    t = type(v)
    return t is float or t is int  # exact types: bool (an int subclass) is not a number here


def plain_hit(raw: object, source: Source) -> MemoryHit | None:
    """``to_hit(raw)`` when ``raw`` keeps the contract in the JSON parser's own types (a ``dict`` of
    exact ``str``, ``int`` and ``float`` values), else None: the caller then asks ``hit_problem``
    why, or whether the hit is sound in a rarer form (a ``Mapping``, say). Every hit a worker
    serves takes this path, so the contract is checked and the hit built in one pass; it never
    accepts a hit ``hit_problem`` refuses (tests/unit/test_hits.py compares them)."""
    if type(raw) is not dict:
        return None
    get: Callable[[str], Any] = raw.get
    mid, content, cat, rank = get("memory_id"), get("content"), get("category"), get("rank")
    sim, conf = get("similarity"), get("confidence")
    if not (type(mid) is str and type(content) is str and type(cat) is str and type(rank) is int
            and rank >= 0 and len(content) <= MAX_CONTENT_CHARS and len(cat) <= MAX_CATEGORY_CHARS
            and _plain_number(sim) and _plain_number(conf) and MEMORY_ID.fullmatch(mid) is not None):
        return None
    comps = get("components")
    if comps is not None:
        if type(comps) is not dict or comps.keys() != _COMPONENT_SET:
            return None
        values = (comps["relevance"], comps["recency"], comps["usefulness"], comps["confidence"], comps["access"])
        if not all(map(_plain_number, values)):
            return None
        comps = (float(values[0]), float(values[1]), float(values[2]), float(values[3]), float(values[4]))
    salience, text, vector, created = get("salience"), get("text_score"), get("vector_score"), get("created_at")
    boost, rerank = get("boost"), get("rerank_score")
    if not all(v is None or _plain_number(v) for v in (salience, text, vector, boost, rerank)) \
            or (created is not None and type(created) is not str):
        return None
    return MemoryHit(
        memory_id=mid, content=content, category=cat, similarity=float(sim), confidence=float(conf), rank=rank,
        source=source, components=comps, salience=None if salience is None else float(salience),
        date=None if created is None else hit_date(created),
        text_score=None if text is None else float(text), vector_score=None if vector is None else float(vector),
        boost=None if boost is None else float(boost), rerank_score=None if rerank is None else float(rerank),
    )


def to_hit(raw: Mapping[str, Any], source: Source) -> MemoryHit:
    """The ``MemoryHit`` of a mapping that passed ``shape_problem``."""
    comps = raw.get("components")
    salience, text, vector = raw.get("salience"), raw.get("text_score"), raw.get("vector_score")
    return MemoryHit(
        memory_id=raw["memory_id"], content=raw["content"], category=raw["category"],
        similarity=float(raw["similarity"]), confidence=float(raw["confidence"]),
        rank=int(raw["rank"]), source=source,
        components=None if comps is None else (
            float(comps["relevance"]), float(comps["recency"]), float(comps["usefulness"]),
            float(comps["confidence"]), float(comps["access"])),
        salience=None if salience is None else float(salience),
        date=hit_date(raw.get("created_at")),
        text_score=None if text is None else float(text), vector_score=None if vector is None else float(vector),
        boost=None if raw.get("boost") is None else float(raw["boost"]),
        rerank_score=None if raw.get("rerank_score") is None else float(raw["rerank_score"]),
    )


BELOW_CUTOFF_MAX: Final = 50  # below-cutoff candidates read from one answer at most
_BELOW_SCORES: Final = (("text_score", "text"), ("vector_score", "vector"), ("boost", "boost"),
                        ("rerank_score", "rerank"), ("relevance", "relevance"), ("composite", "composite"))


def below_cutoff(rows: object, source: Source) -> list[Rejection]:
    """The candidates a search answer lists under its line (``below_cutoff``: memory ids, scores and
    why), as ``below_cutoff`` rejections for the decisions. Diagnostic only: a row that is not an
    object with a valid memory_id and a string reason is left out, never an error."""
    if not isinstance(rows, list):
        return []
    out: list[Rejection] = []
    for row in rows[:BELOW_CUTOFF_MAX]:
        if not _is_mapping(row) or memory_id_problem(row.get("memory_id")) is not None \
                or not isinstance(row.get("reason"), str):
            continue
        scores = {name: float(row[key]) for key, name in _BELOW_SCORES if _is_number(row.get(key))}
        composite = scores.get("composite")
        out.append(Rejection(row["memory_id"], source, "below_cutoff",
                             f"under the search's line: {row['reason'][:300]}",
                             score=composite if composite is not None and 0.0 <= composite <= 1.0 else None,
                             retrieval=scores or None))
    return out


def over_cap(memory_id: str, source: Source, cap: int) -> Rejection:
    return Rejection(memory_id, source, "over_cap", f"beyond the {source} cap of {cap} hits")


def offline_result(
    *, directive: str | None, hot: list[MemoryHit], cold: list[MemoryHit],
    hot_cap: int = 20, cold_cap: int = 50,
) -> RetrievalResult:
    """A RetrievalResult from given hits (``ops explain``, benchmarks): each branch succeeded and
    kept at most its cap, as the retriever would have (no I/O happens)."""
    rejects = [over_cap(extra.memory_id, extra.source, cap)
               for hits, cap in ((hot, hot_cap), (cold, cold_cap)) for extra in hits[cap:]]
    hot, cold = hot[:hot_cap], cold[:cold_cap]
    ok = BranchOutcome(status="success", elapsed_ms=0.0)
    return RetrievalResult(
        directive=directive, hot=tuple(hot), cold=tuple(cold), rejections=tuple(rejects),
        outcomes={"directive": ok.model_copy(update={"count": int(directive is not None)}),
                  "hot": ok.model_copy(update={"count": len(hot)}),
                  "cold": ok.model_copy(update={"count": len(cold)})},
    )


def failed_result(directive: str | None, outcome: BranchOutcome) -> RetrievalResult:
    """A RetrievalResult where every branch failed with ``outcome`` (the client's degraded path)."""
    return RetrievalResult(directive=directive, hot=(), cold=(), rejections=(),
                           outcomes={"directive": outcome, "hot": outcome, "cold": outcome})
