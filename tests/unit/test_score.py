"""Scoring stage: the interim score and one decision per memory (docs/assembly.md "Scoring and packing")."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.pipeline.selection.score import INTERIM_WEIGHTS, interim_score, score_candidates
from ibex_context.pipeline.types import MemoryHit


def _hit(memory_id: str = "m1", similarity: Any = 0.8, confidence: Any = 0.6) -> MemoryHit:
    return MemoryHit(memory_id, "body", "fact", similarity, confidence, 0, "cold")


def _cost(hit: MemoryHit) -> int:
    return 10 + len(hit.memory_id)


unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def test_weights_are_the_spec_interim() -> None:
    assert INTERIM_WEIGHTS == (0.85, 0.15)
    assert interim_score(1.0, 0.0) == pytest.approx(0.85)
    assert interim_score(0.0, 1.0) == pytest.approx(0.15)
    assert interim_score(1.0, 1.0) == 1.0


@given(similarity=unit, confidence=unit)
def test_valid_hit_gets_interim_score_and_cost(similarity: float, confidence: float) -> None:
    hit = _hit("abc", similarity, confidence)
    scored, rejected = score_candidates([hit], _cost)
    assert rejected == []
    (m,) = scored
    assert m.hit is hit
    assert m.tokens == 13
    assert m.composite_score == pytest.approx(0.85 * similarity + 0.15 * confidence, abs=1e-12)
    assert 0.0 <= m.composite_score <= 1.0


def test_integer_endpoints_are_numbers() -> None:
    scored, rejected = score_candidates([_hit(similarity=1, confidence=0)], _cost)
    assert rejected == [] and scored[0].composite_score == pytest.approx(0.85)


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("similarity", math.nan, "similarity must be finite, got nan"),
        ("similarity", math.inf, "similarity must be finite, got inf"),
        ("confidence", -math.inf, "confidence must be finite, got -inf"),
        ("similarity", 1.0000001, "similarity must be in [0, 1], got 1.0000001"),
        ("confidence", -0.01, "confidence must be in [0, 1], got -0.01"),
        ("similarity", 2, "similarity must be in [0, 1], got 2"),
        ("similarity", True, "similarity must be a number in [0, 1], got bool True"),
        ("confidence", False, "confidence must be a number in [0, 1], got bool False"),
        ("similarity", "0.9", "similarity must be a number in [0, 1], got str '0.9'"),
        ("confidence", None, "confidence must be a number in [0, 1], got NoneType None"),
    ],
)
def test_invalid_scores_rejected_with_reason(field: str, value: Any, expect: str) -> None:
    calls: list[str] = []

    def cost(hit: MemoryHit) -> int:
        calls.append(hit.memory_id)
        return 5

    bad = _hit("bad", **{field: value})
    scored, rejected = score_candidates([_hit("ok"), bad], cost)
    assert [m.memory_id for m in scored] == ["ok"]
    (r,) = rejected
    assert (r.memory_id, r.source, r.decision) == ("bad", "cold", "invalid_score")
    assert expect in r.reason
    assert calls == ["ok"]  # no cost is computed for a hit that cannot be packed


def test_both_fields_named_when_both_bad() -> None:
    _, rejected = score_candidates([_hit(similarity=math.nan, confidence=7.0)], _cost)
    assert "similarity" in rejected[0].reason and "confidence" in rejected[0].reason


def test_below_floor() -> None:
    low, exact, high = _hit("low", 0.5, 0.5), _hit("exact", 0.8, 0.8), _hit("high", 0.9, 0.9)
    scored, rejected = score_candidates([low, exact, high], _cost, min_score=0.8)
    assert [m.memory_id for m in scored] == ["exact", "high"]  # at the floor is kept
    (r,) = rejected
    assert r.decision == "below_floor" and r.memory_id == "low"
    assert r.score == pytest.approx(0.5)
    assert "0.5000" in r.reason and "0.8000" in r.reason


@pytest.mark.parametrize("floor", [math.nan, -0.1, 1.5, True])
def test_invalid_floor_is_a_programming_error(floor: Any) -> None:
    with pytest.raises(ValueError, match="min_score"):
        score_candidates([_hit()], _cost, min_score=floor)


def test_cost_that_raises_rejects_only_that_hit() -> None:
    def cost(hit: MemoryHit) -> int:
        if hit.memory_id == "boom":
            raise RuntimeError("formatter exploded")
        return 3

    scored, rejected = score_candidates([_hit("a"), _hit("boom"), _hit("b")], cost)
    assert [m.memory_id for m in scored] == ["a", "b"]
    (r,) = rejected
    assert r.decision == "invalid_score"
    assert "RuntimeError" in r.reason and "formatter exploded" in r.reason


@pytest.mark.parametrize(
    ("value", "shown"), [(-1, "int -1"), (2.5, "float 2.5"), (True, "bool True"), ("7", "str '7'")]
)
def test_bad_cost_values_rejected(value: Any, shown: str) -> None:
    scored, rejected = score_candidates([_hit()], lambda _h: value)
    assert scored == []
    assert rejected[0].decision == "invalid_score"
    assert shown in rejected[0].reason


def test_zero_cost_is_fine_and_order_is_kept() -> None:
    hits = [_hit(f"m{i}", 0.9 - i / 10, 0.5) for i in range(5)]
    scored, rejected = score_candidates(hits, lambda _h: 0)
    assert rejected == []
    assert [m.memory_id for m in scored] == [h.memory_id for h in hits]
    assert all(m.tokens == 0 for m in scored)


anything = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-3, max_value=3),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


@given(values=st.lists(st.tuples(anything, anything, st.integers(-5, 50)), max_size=20), floor=unit)
def test_every_hit_is_accounted_for_and_nothing_raises(values: list[tuple[Any, Any, int]], floor: float) -> None:
    hits = [_hit(f"m{i}", s, c) for i, (s, c, _) in enumerate(values)]
    costs = {h.memory_id: t for h, (_, _, t) in zip(hits, values, strict=True)}
    scored, rejected = score_candidates(hits, lambda h: costs[h.memory_id], min_score=floor)
    assert sorted([m.memory_id for m in scored] + [r.memory_id for r in rejected]) == sorted(costs)
    for m in scored:
        assert floor <= m.composite_score <= 1.0 and m.tokens >= 0
    for r in rejected:
        assert r.reason
        if r.decision == "below_floor":
            assert r.score is not None and r.score < floor


# ------------------------------------------------------------------ ids and duplicates: one decision per memory


def _copy(memory_id: str, similarity: Any, source: str = "hot", rank: int = 0) -> MemoryHit:
    return MemoryHit(memory_id, "body", "fact", similarity, 0.5, rank, source)  # type: ignore[arg-type]


@pytest.mark.parametrize("memory_id", ["", "a b", "x" * 65, "a:b", "é"])
def test_memory_id_outside_the_identifier_alphabet_is_malformed(memory_id: str) -> None:
    costed: list[str] = []

    def cost(h: MemoryHit) -> int:
        costed.append(h.memory_id)
        return 1

    scored, rejected = score_candidates([_hit("ok"), _hit(memory_id)], cost)
    assert [m.memory_id for m in scored] == ["ok"] and costed == ["ok"]
    assert [(r.memory_id, r.decision) for r in rejected] == [("<cold#1>", "malformed")]
    assert "must be 1-64 characters of [A-Za-z0-9_.-]" in rejected[0].reason


def test_hot_and_cold_copies_keep_the_higher_score() -> None:
    scored, rejected = score_candidates([_copy("a", 0.6, "hot", 3), _copy("a", 0.9, "cold", 1)], _cost)
    assert [(m.memory_id, m.hit.source) for m in scored] == [("a", "cold")]
    assert [(r.memory_id, r.source, r.decision) for r in rejected] == [("a", "hot", "duplicate")]
    assert rejected[0].reason == ("duplicate memory_id: the copy cold #0 (rank 1) was kept "
                                  "(its interim score 0.8400 beats this copy's 0.5850)")


def test_a_valid_copy_is_never_hidden_behind_an_invalid_one() -> None:
    """The old merge kept the higher similarity, then the scorer refused that copy: no decision
    for the memory said 'packed' although a valid copy had arrived."""
    scored, rejected = score_candidates([_copy("a", math.nan, "hot"), _copy("a", 0.5, "cold")], _cost)
    assert [(m.memory_id, m.hit.source) for m in scored] == [("a", "cold")]
    assert [r.decision for r in rejected] == ["duplicate"]
    assert rejected[0].reason.endswith("was kept (this copy's scores are invalid)")


def test_ties_prefer_hot_then_the_first_returned() -> None:
    scored, rejected = score_candidates([_copy("a", 0.7, "cold"), _copy("a", 0.7, "hot")], _cost)
    assert scored[0].hit.source == "hot"
    assert rejected[0].reason.endswith("(same interim score 0.6700; the hot copy is preferred)")
    scored, rejected = score_candidates([_copy("b", 0.7, "cold", 4), _copy("b", 0.7, "cold", 4)], _cost)
    assert len(scored) == 1 and rejected[0].source == "cold"
    assert rejected[0].reason == ("duplicate memory_id: the copy cold #0 (rank 4) was kept "
                                  "(same interim score 0.6700; the copy returned first is kept)")


def test_only_invalid_copies_give_one_invalid_score_and_duplicates() -> None:
    scored, rejected = score_candidates([_copy("a", math.inf, "cold"), _copy("a", -1.0, "hot")], _cost)
    assert scored == []
    assert sorted((r.source, r.decision) for r in rejected) == [("cold", "duplicate"), ("hot", "invalid_score")]


@given(copies=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "", "d d"]), anything,
                                 st.sampled_from(["hot", "cold"])), max_size=15))
def test_exactly_one_decision_per_distinct_memory(copies: list[tuple[str, Any, str]]) -> None:
    hits = [_copy(mid, sim, src, i) for i, (mid, sim, src) in enumerate(copies)]
    scored, rejected = score_candidates(hits, _cost)
    named = [h.memory_id for h in hits if h.memory_id in ("a", "b", "c")]
    primary = [m.memory_id for m in scored] + [r.memory_id for r in rejected if r.decision not in ("duplicate",
                                                                                                   "malformed")]
    assert sorted(primary) == sorted(set(named))  # one answer per distinct valid id
    assert len([r for r in rejected if r.decision == "duplicate"]) == len(named) - len(set(named))
    assert len([r for r in rejected if r.decision == "malformed"]) == len(hits) - len(named)
