"""``plain_hit`` (the worker's one-pass check and build) against the contract's full check."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.selection.hits import MAX_CATEGORY_CHARS, hit_problem, plain_hit, to_hit
from tests.properties import examples

NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans())
ODD = st.one_of(st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2),
                st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
IDS = st.one_of(st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True), st.text(max_size=70), st.integers())
COMPONENTS = ("relevance", "recency", "usefulness", "confidence", "access")


@st.composite
def raw_hits(draw: st.DrawFn) -> Any:
    """JSON-shaped hits, most of them sound, each field sometimes missing or of another type."""
    def field(sound: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(sound, ODD) if draw(st.integers(0, 9)) == 0 else sound)

    raw: dict[str, Any] = {
        "memory_id": field(IDS),
        "content": field(st.text(max_size=30)),
        "category": field(st.text(max_size=MAX_CATEGORY_CHARS + 2)),
        "similarity": field(NUMBERS),
        "confidence": field(NUMBERS),
        "rank": field(st.one_of(st.integers(-2, 50), st.booleans(), st.floats(0, 3))),
    }
    if draw(st.booleans()):
        names = draw(st.sampled_from([COMPONENTS, COMPONENTS[:4], (*COMPONENTS, "extra")]))
        raw["components"] = field(st.fixed_dictionaries({k: NUMBERS for k in names}))
    for key in ("salience", "text_score", "vector_score"):
        if draw(st.booleans()):
            raw[key] = field(st.one_of(st.none(), NUMBERS))
    if draw(st.booleans()):
        raw["created_at"] = field(st.one_of(st.none(), st.text(max_size=12), st.just("2026-11-28T05:04:46Z")))
    for key in draw(st.lists(st.sampled_from(sorted(raw)), max_size=1)):
        del raw[key]
    return raw


@settings(max_examples=examples(600), deadline=None)
@given(raw=st.one_of(raw_hits(), ODD))
def test_plain_hit_accepts_only_sound_hits_and_builds_what_to_hit_builds(raw: Any) -> None:
    """For what a JSON parser makes, the one pass and the full check agree on every hit."""
    hit = plain_hit(raw, "cold")
    problem = hit_problem(raw)
    assert (hit is None) == (problem is not None), (raw, problem)
    if hit is not None:
        assert hit == to_hit(raw, "cold")


def test_a_sound_hit_in_json_types_takes_the_one_pass_path() -> None:
    raw = {"memory_id": "m-1", "content": "Prefers email.", "category": "preference", "similarity": 0.4,
           "confidence": 1, "rank": 1, "components": dict.fromkeys(COMPONENTS, 0.5), "salience": 0.2,
           "text_score": None, "created_at": "2026-11-28T05:04:46Z"}
    hit = plain_hit(raw, "hot")
    assert hit is not None and hit == to_hit(raw, "hot")
    assert hit.date == "2026-11-28" and hit.confidence == 1.0 and type(hit.confidence) is float
    assert plain_hit({**raw, "similarity": True}, "hot") is None  # a bool is no score; hit_problem says why
    assert hit_problem({**raw, "similarity": True}) == "similarity must be a number"
