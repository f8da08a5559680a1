"""Search's ranking stages beyond plain fusion, and what explain shows of them (pure, no I/O):
z-score fusion, the subject boost, subjects named by a question, the dated indexed text, the
line a search draws and the candidates under it, and those candidates as decisions."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.memory.search.cutoff import cosine_reason, cut
from ibex_context.memory.search.fusion import Fused, boosted, fuse
from ibex_context.memory.search.indexed_text import date_words, searched_text
from ibex_context.memory.search.subjects import derive_subject, names, question_words, subject_of
from ibex_context.pipeline.decisions import decisions, retrieval_scores
from ibex_context.pipeline.selection.hits import below_cutoff, plain_hit, to_hit
from ibex_context.pipeline.types import MemoryHit, RetrievalResult, ScoredMemory
from ibex_context.shared.wire.models import BranchOutcome
from tests.properties import examples

unit = st.floats(0.0, 1.0, allow_nan=False)

# ------------------------------------------------------------------------------------ z-score fusion


def test_zscore_fusion_orders_by_the_weighted_standard_scores() -> None:
    text = {"a": 0.9, "b": 0.1}
    cos = {"a": 0.5, "b": 0.6, "c": 0.75}
    got = fuse(text, cos, min_similarity=0.7, text_weight=0.7, rule="zscore")
    assert set(got) == {"a", "b", "c"}  # c by its cosine; a and b by their words
    # a: far above the mean on text, below it on cosine; with most weight on text it beats c
    assert got["a"].relevance > got["c"].relevance > got["b"].relevance
    assert (got["a"].text, got["a"].vector) == (0.9, 0.5)
    zt = (0.9 - 1.0 / 3) / math.sqrt(((0.9 - 1 / 3) ** 2 + (0.1 - 1 / 3) ** 2 + (1 / 3) ** 2) / 3)
    mean_v = (0.5 + 0.6 + 0.75) / 3
    zv = (0.5 - mean_v) / math.sqrt(((0.5 - mean_v) ** 2 + (0.6 - mean_v) ** 2 + (0.75 - mean_v) ** 2) / 3)
    assert math.isclose(got["a"].relevance, 1 / (1 + math.exp(-(0.7 * zt + 0.3 * zv))), rel_tol=1e-9)
    light = fuse(text, cos, min_similarity=0.7, text_weight=0.4, rule="zscore")
    assert light["c"].relevance > light["a"].relevance > light["b"].relevance  # the weight decides


def test_zscore_fusion_of_scores_that_do_not_spread_is_neutral() -> None:
    got = fuse({"a": 0.5, "b": 0.5}, {"a": 0.8, "b": 0.8}, min_similarity=0.7, rule="zscore")
    assert got["a"].relevance == got["b"].relevance == 0.5


@settings(max_examples=examples(200))
@given(st.dictionaries(st.sampled_from("abcdef"), st.tuples(unit, unit), min_size=1), st.floats(0.0, 1.0))
def test_zscore_relevance_is_in_unit_range(cands: dict[str, tuple[float, float]], w: float) -> None:
    got = fuse({m: t for m, (t, _) in cands.items()}, {m: v for m, (_, v) in cands.items()},
               min_similarity=0.0, text_weight=w, rule="zscore")
    assert all(0.0 <= f.relevance <= 1.0 and math.isfinite(f.relevance) for f in got.values())


# ------------------------------------------------------------------------------------ subject boost


def test_boost_lifts_only_memories_about_a_named_person_and_records_it() -> None:
    fused = {"about": Fused(0.5, 0.2, 0.4), "other": Fused(0.5, 0.2, 0.4)}
    got = boosted(fused, {"about": True, "other": False}, 0.3)
    assert got["about"].relevance == 0.5 + 0.3 * 0.5 and got["about"].boost == 0.3
    assert got["other"] == fused["other"] and got["other"].boost == 0.0
    assert boosted(fused, {"about": True}, 0.0) == fused  # off


@settings(max_examples=examples(200))
@given(unit, unit)
def test_boost_never_lowers_nor_passes_one(rel: float, boost: float) -> None:
    got = boosted({"m": Fused(rel, 0.0, rel)}, {"m": True}, boost)["m"].relevance
    assert rel <= got <= 1.0


# ------------------------------------------------------------------------------------ subjects


def test_subject_is_the_writers_else_the_speaker_of_a_turn() -> None:
    assert derive_subject("Priya: went to see The Brass Comets") == "Priya"
    assert derive_subject("Mary Ann Lee: hello there") == "Mary Ann Lee"
    assert derive_subject("note: buy milk") is None  # not a name
    assert derive_subject("The user prefers tea") is None
    assert derive_subject("Time: 10:30 is fine") == "Time"  # a capitalised word before a colon reads as one
    assert subject_of("Jonah", "Priya: he said so") == "Jonah"
    assert subject_of(None, "Priya: he said so") == "Priya"


def test_a_question_names_a_subject_by_its_first_name_in_any_case() -> None:
    words = question_words("When did JONAH's dad visit Bergen?")
    assert names(words, "Jonah") and names(words, "Jonah Park")
    assert not names(words, "Priya") and not names(words, None) and not names(words, "")
    assert not names(question_words("Who jonahed?"), "Jonah")  # a whole word, not a prefix


# ------------------------------------------------------------------------------------ dated indexed text


def test_the_indexed_text_ends_with_the_utc_day_in_words() -> None:
    ts = datetime(2023, 7, 4, 23, 30, tzinfo=timezone(timedelta(hours=-5)))  # 5 July in UTC
    assert date_words(ts) == "5 July 2023"
    assert searched_text("Priya: we adopted her!", ts) == "Priya: we adopted her! (5 July 2023)"
    assert date_words(datetime(2024, 12, 31, tzinfo=UTC)) == "31 December 2024"


# ------------------------------------------------------------------------------------ the line


def test_cut_keeps_the_limit_and_names_the_next_under_the_line() -> None:
    rel = [0.9, 0.1, 0.8, 0.7, 0.6, 0.5]
    kept, below = cut([0, 1, 2, 3, 4, 5], rel, floor=0.15, limit=2, shown=3)
    assert kept == [0, 2]
    assert [i for i, _ in below] == [1, 3, 4]
    assert "under the floor 0.15" in below[0][1] and "after the 2 hits" in below[1][1]
    assert cut([0, 1], [0.9, 0.8], floor=0.0, limit=5, shown=3) == ([0, 1], [])
    assert cut([0, 1], [0.9, 0.8], floor=0.0, limit=1, shown=0) == ([0], [])


@settings(max_examples=examples(200))
@given(st.lists(unit, max_size=30), st.integers(0, 10), st.integers(0, 5), unit)
def test_cut_never_answers_under_the_floor_nor_past_the_limit(rel: list[float], limit: int, shown: int,
                                                              floor: float) -> None:
    floor = min(floor, 0.49)
    kept, below = cut(list(range(len(rel))), rel, floor=floor, limit=limit, shown=shown)
    assert len(kept) <= limit and len(below) <= shown and all(rel[i] >= floor for i in kept)
    assert not set(kept) & {i for i, _ in below}
    assert kept == [i for i in range(len(rel)) if rel[i] >= floor][:limit]


def test_cosine_reason_says_both_numbers() -> None:
    assert cosine_reason(0.41234, 0.3) == ("cosine 0.412 is under the cutoff 0.3 and it holds no word of the "
                                           "question")


# ------------------------------------------------------------------------------------ explain


def _hit(mid: str, **extra: object) -> dict[str, object]:
    return {"memory_id": mid, "content": "x", "category": "note", "similarity": 0.6, "confidence": 0.8,
            "rank": 1, **extra}


def test_a_search_hit_carries_its_boost_to_the_decision_scores() -> None:
    raw = _hit("m1", text_score=0.5, vector_score=0.4, boost=0.15)
    for hit in (plain_hit(raw, "cold"), to_hit(raw, "cold")):
        assert hit is not None and hit.boost == 0.15
        assert retrieval_scores(ScoredMemory(hit, 3, 0.5)) == {"text": 0.5, "vector": 0.4, "boost": 0.15}
    assert plain_hit(_hit("m1", boost="high"), "cold") is None  # a wrong type is refused


def test_below_cutoff_rows_become_decisions_with_their_scores() -> None:
    rows = [{"memory_id": "m9", "content": "late", "reason": "ranked 3, after the 2 hits the search returns",
             "relevance": 0.41, "composite": 0.3, "text_score": 0.2, "vector_score": 0.35, "boost": 0.0},
            {"memory_id": "m8", "reason": "cosine 0.250 is under the cutoff 0.3", "vector_score": 0.25},
            {"memory_id": "bad id!", "reason": "x"}, {"memory_id": "m7"}, "junk"]
    rejects = below_cutoff(rows, "cold")
    assert [r.memory_id for r in rejects] == ["m9", "m8"]
    assert rejects[0].score == 0.3 and rejects[0].retrieval == {"text": 0.2, "vector": 0.35, "boost": 0.0,
                                                                  "relevance": 0.41, "composite": 0.3}
    assert rejects[1].score is None and rejects[1].retrieval == {"vector": 0.25}
    assert below_cutoff("nope", "cold") == []
    ok = BranchOutcome(status="success", elapsed_ms=0.0)
    packed = MemoryHit("m9", "x", "note", 0.5, 0.5, 1, "hot")
    result = RetrievalResult(directive=None, hot=(packed,), cold=(), rejections=tuple(rejects),
                             outcomes={"directive": ok, "hot": ok, "cold": ok})
    got = decisions(result, [], [ScoredMemory(packed, 3, 0.5)], [], [], 100)
    by_id = {d["memory_id"]: d for d in got}
    assert by_id["m9"]["decision"] == "packed"  # came in by the hot branch: answered there, not twice
    assert by_id["m8"]["decision"] == "below_cutoff" and by_id["m8"]["retrieval"] == {"vector": 0.25}
    assert by_id["m8"]["reason"].startswith("under the search's line: cosine 0.250")
    assert len(got) == 2
