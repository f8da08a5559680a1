"""Pure ranking and embedding math of the reference memory service (no I/O)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.memory.embedders.embed import EmbedderUnavailable, HashingEmbedder, content_terms, load_embedder
from ibex_context.memory.search.fusion import TEXT_WEIGHT, Fused, fuse, idf, text_scores
from ibex_context.memory.search.index import MAX_QUERY_TERMS, query_terms, tenant_filter
from ibex_context.memory.search.rank import (
    ACCESS_SATURATION,
    DEFAULT_RELEVANCE_FLOOR,
    FLOOR_LIMIT,
    HALF_LIFE_DAYS,
    WEIGHTS,
    access_score,
    check_relevance_floor,
    cosine_scores,
    rank_arrays,
    record_features,
)
from tests.helpers import Candidate, composite, rank_hydrated_hits, recency_score

DAY = 86_400.0
NOW = 1_800_000_000.0
unit = st.floats(0.0, 1.0, allow_nan=False)


def _cand(mid: str, rel: float = 0.8, *, cat: str = "fact", age_days: float = 0.0, useful: float = 0.5,
          conf: float = 0.5, access: int = 0) -> Candidate:
    return Candidate(mid, rel, cat, NOW - age_days * DAY, useful, conf, access)


# ------------------------------------------------------------------------------------ weights


def test_weights_are_the_spec_weights() -> None:
    assert (WEIGHTS.relevance, WEIGHTS.recency, WEIGHTS.usefulness, WEIGHTS.confidence, WEIGHTS.access) == (
        0.40, 0.25, 0.20, 0.10, 0.05,
    )
    assert math.isclose(WEIGHTS.total(), 1.0)


def test_each_component_carries_its_weight() -> None:
    zero = dict(relevance=0.0, recency=0.0, usefulness=0.0, confidence=0.0, access=0.0)
    for name, w in [("relevance", 0.40), ("recency", 0.25), ("usefulness", 0.20), ("confidence", 0.10),
                    ("access", 0.05)]:
        assert math.isclose(composite(**{**zero, name: 1.0}), w)
    assert math.isclose(composite(**{k: 1.0 for k in zero}), 1.0)


@given(r=unit, rec=unit, u=unit, c=unit, a=unit)
def test_composite_is_a_convex_combination(r: float, rec: float, u: float, c: float, a: float) -> None:
    s = composite(relevance=r, recency=rec, usefulness=u, confidence=c, access=a)
    assert 0.0 <= s <= 1.0 + 1e-12
    assert composite(relevance=min(r + 0.1, 1.0), recency=rec, usefulness=u, confidence=c, access=a) >= s


# -------------------------------------------------------------------------------- half-lives


@pytest.mark.parametrize("cat,days", [("preference", 180), ("fact", 365), ("event", 14), ("task", 7)])
def test_half_lives(cat: str, days: float) -> None:
    assert HALF_LIFE_DAYS[cat] == days
    assert math.isclose(recency_score(days * DAY, cat), 0.5)
    assert math.isclose(recency_score(2 * days * DAY, cat), 0.25)
    assert recency_score(0.0, cat) == 1.0


def test_recency_edge_cases() -> None:
    assert recency_score(-5 * DAY, "task") == 1.0  # clock skew: not "more recent than now"
    assert recency_score(math.inf, "task") == 0.0
    assert math.isclose(recency_score(30 * DAY, "unknown-category"), 0.5)  # default half-life
    assert recency_score(30 * DAY, "task") < recency_score(30 * DAY, "event") < recency_score(30 * DAY, "fact")


@given(age=st.floats(0, 3650 * DAY), cat=st.sampled_from(sorted(HALF_LIFE_DAYS)))
def test_recency_is_monotone_and_bounded(age: float, cat: str) -> None:
    r = recency_score(age, cat)
    assert 0.0 <= r <= 1.0
    assert recency_score(age + DAY, cat) <= r


def test_access_score() -> None:
    assert access_score(0) == 0.0 and access_score(-3) == 0.0
    assert access_score(ACCESS_SATURATION) == 1.0 and access_score(10**9) == 1.0
    assert 0 < access_score(1) < access_score(10) < 1


# --------------------------------------------------------------------- fusion, floor, cutoff


def test_text_scores_weigh_words_by_idf_and_bm25() -> None:
    # 100 memories; "bergen" is in 1, "jonah" in 50. m1 holds both (best for each), m2 only "jonah".
    got = text_scores([{"m1": 9.0}, {"m1": 2.0, "m2": 4.0}], [1, 50], 100)
    w_rare, w_common = idf(1, 100), idf(50, 100)
    assert w_rare > 5 * w_common
    assert got["m1"] == pytest.approx((w_rare + w_common * 0.5) / (w_rare + w_common))
    assert got["m2"] == pytest.approx(w_common / (w_rare + w_common)) and got["m2"] < 0.2
    # A question word no memory holds lowers every text score (it is still asked for).
    assert text_scores([{"m1": 9.0}, {}], [1, 0], 100)["m1"] < text_scores([{"m1": 9.0}], [1], 100)["m1"]
    assert text_scores([], [], 100) == {} and text_scores([{}], [0], 100) == {}


def test_fusion_lifts_the_cosine_by_the_text_score_and_never_lowers_it() -> None:
    got = fuse({"a": 1.0, "b": 0.25}, {"a": 0.4, "b": 0.9, "c": 0.75, "d": 0.2}, min_similarity=0.7)
    assert set(got) == {"a", "b", "c"}  # d: no word matched and its cosine is under the cutoff
    assert got["a"] == Fused(relevance=pytest.approx(0.4 + 0.8 * 1.0 * 0.6), text=1.0, vector=pytest.approx(0.4))
    assert got["b"].relevance == pytest.approx(0.9 + 0.8 * 0.25 * 0.1)
    assert got["c"].text == 0.0 and got["c"].relevance == pytest.approx(0.75)  # meaning alone: its cosine


def test_fusion_is_total_on_bad_numbers() -> None:
    got = fuse({"a": math.nan, "b": math.inf, "c": 1.0}, {"a": math.nan, "c": 1.5, "e": -0.3}, min_similarity=0.0)
    for f in got.values():
        assert 0.0 <= f.relevance <= 1.0 and 0.0 <= f.text <= 1.0 and 0.0 <= f.vector <= 1.0
    assert fuse({}, {}, min_similarity=0.3) == {}


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0.0, 1.0)),
       st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-1.0, 1.0)), st.floats(0.0, 1.0))
def test_fusion_properties(text: dict[str, float], cosine: dict[str, float], cut: float) -> None:
    got = fuse(text, cosine, min_similarity=cut)
    for mid, f in got.items():
        assert 0.0 <= f.relevance <= 1.0
        assert text.get(mid, 0.0) > 0.0 or f.vector >= cut  # a word match, or a cosine over the cutoff
        assert f.relevance == pytest.approx(f.vector + TEXT_WEIGHT * f.text * (1 - f.vector))
        assert f.relevance >= f.vector - 1e-12  # words never lower a memory
    assert {m for m, v in text.items() if v > 0.0} <= set(got)  # every candidate that matched a word is kept


@given(st.lists(st.dictionaries(st.sampled_from("abcdef"), st.floats(0.0, 30.0)), max_size=6),
       st.integers(1, 1000))
def test_text_scores_are_in_unit_range(per_word: list[dict[str, float]], n: int) -> None:
    dfs = [min(len(w), n) for w in per_word]
    for v in text_scores(per_word, dfs, n).values():
        assert 0.0 < v <= 1.0


def test_query_terms_and_tenant_filter_are_escaped() -> None:
    assert query_terms("When did Caroline go to the LGBTQ support group?") == ["caroline", "go", "lgbtq", "support",
                                                                              "group"]
    assert query_terms("a-b|c) @org:{globex} *") == ["org", "globex"]  # punctuation never reaches the query
    assert query_terms("") == [] and len(query_terms(" ".join(f"w{i}" for i in range(100)))) == MAX_QUERY_TERMS == 16
    assert tenant_filter("ac.me", "bot-1") == "@org:{ac\\.me} @agent:{bot\\-1}"
    with pytest.raises(ValueError):
        tenant_filter("acme} | @org:{globex", "bot")


@pytest.mark.parametrize("bad", [0.5, 0.51, 1.0, 7.0, -0.01, math.nan, math.inf])
def test_floor_at_or_above_half_is_refused(bad: float) -> None:
    with pytest.raises(ValueError):
        check_relevance_floor(bad)
    with pytest.raises(ValueError):
        rank_hydrated_hits([_cand("a")], now_s=NOW, relevance_floor=bad, limit=5)


def test_floor_refusal_says_why() -> None:
    with pytest.raises(ValueError, match=r"full-text hits"):
        check_relevance_floor(0.5)
    assert check_relevance_floor(0.49) == 0.49 and check_relevance_floor(0) == 0.0
    assert FLOOR_LIMIT == 0.5 < TEXT_WEIGHT  # a memory matching all the question's words passes any floor
    assert DEFAULT_RELEVANCE_FLOOR == 0.15


def test_cosine_scores() -> None:
    m = np.eye(3, dtype=np.float32)
    q = np.array([0.6, 0.8, 0.0], dtype=np.float32)
    assert cosine_scores(m, q).tolist() == pytest.approx([0.6, 0.8, 0.0])
    assert cosine_scores(np.zeros((0, 3), dtype=np.float32), q).shape == (0,)


# ------------------------------------------------------------------------------------ ranking


def test_rank_orders_by_composite_then_id_and_cuts() -> None:
    cands = [
        _cand("old-task", 0.9, cat="task", age_days=60),
        _cand("fresh-task", 0.9, cat="task", age_days=0),
        _cand("twin-b", 0.8), _cand("twin-a", 0.8),
        _cand("useful", 0.8, useful=1.0, conf=1.0, access=1000),
    ]
    ranked = rank_hydrated_hits(cands, now_s=NOW, limit=4)
    assert [r.candidate.memory_id for r in ranked] == ["useful", "fresh-task", "twin-a", "twin-b"]
    assert [r.rank for r in ranked] == [1, 2, 3, 4]
    assert ranked[0].score == pytest.approx(0.4 * 0.8 + 0.25 + 0.2 + 0.1 + 0.05)
    assert rank_hydrated_hits(cands, now_s=NOW, limit=0) == []


def test_non_finite_candidates_are_dropped() -> None:
    bad = [_cand("nan", math.nan), Candidate("inf", 0.8, "fact", math.inf, 0.5, 0.5, 0)]
    assert rank_hydrated_hits([*bad, _cand("ok")], now_s=NOW, limit=5)[0].candidate.memory_id == "ok"
    assert len(rank_hydrated_hits([*bad, _cand("ok")], now_s=NOW, limit=5)) == 1


@given(st.lists(st.tuples(st.floats(0.15, 1.0), unit, unit, st.floats(0, 400), st.integers(0, 500)),
                max_size=30), st.integers(0, 40))
def test_ranking_invariants(rows: list[tuple[float, float, float, float, int]], limit: int) -> None:
    cands = [_cand(f"m{i}", rel, useful=u, conf=c, age_days=age, access=n)
             for i, (rel, u, c, age, n) in enumerate(rows)]
    ranked = rank_hydrated_hits(cands, now_s=NOW, limit=limit)
    assert len(ranked) == min(limit, len(cands))
    assert [r.rank for r in ranked] == list(range(1, len(ranked) + 1))
    keys = [(-r.score, r.candidate.memory_id) for r in ranked]
    assert keys == sorted(keys)
    assert all(0.0 <= r.score <= 1.0 + 1e-9 for r in ranked)


def _arrays(cands: list[Candidate], **kw: Any) -> list[tuple[str, float, float]]:
    feats = [record_features(c.created_at_s, c.category, c.usefulness, c.confidence, c.access_count) for c in cands]
    kept, scores, recencies = rank_arrays([c.memory_id for c in cands], [c.relevance for c in cands], feats, **kw)
    return [(cands[i].memory_id, s, r) for i, s, r in zip(kept, scores, recencies, strict=True)]


@given(st.lists(st.tuples(st.floats(0.0, 1.0), unit, unit, st.floats(-2, 400), st.integers(0, 500),
                          st.sampled_from([*sorted(HALF_LIFE_DAYS), "other"])), max_size=30),
       st.integers(0, 40), st.sampled_from([0.0, 0.15, 0.3]))
def test_array_ranking_is_the_scalar_ranking(rows: list[tuple[float, float, float, float, int, str]], limit: int,
                                             floor: float) -> None:
    """The service ranks with rank_arrays; rank_hydrated_hits is the reference it must equal."""
    cands = [_cand(f"m{i % 7}-{i}", rel, useful=u, conf=c, age_days=age, access=n, cat=cat)
             for i, (rel, u, c, age, n, cat) in enumerate(rows)]
    cands += [_cand("nan", math.nan), Candidate("inf", 0.8, "fact", math.inf, 0.5, 0.5, 0)]
    ref = rank_hydrated_hits(cands, now_s=NOW, relevance_floor=floor, limit=limit)
    got = _arrays(cands, now_s=NOW, relevance_floor=floor, limit=limit)
    assert [g[0] for g in got] == [r.candidate.memory_id for r in ref]
    assert [g[1] for g in got] == pytest.approx([r.score for r in ref], abs=1e-12)
    assert [g[2] for g in got] == pytest.approx([r.recency for r in ref], abs=1e-12)


# ---------------------------------------------------------------------------------- embedding


def test_hashing_embedder_is_deterministic_and_unit() -> None:
    e = HashingEmbedder()
    a = e.embed(["User prefers dark mode", "User prefers dark mode", ""])
    assert a.dtype == np.float32 and a.shape == (3, e.dim)
    assert np.array_equal(a[0], a[1])
    assert math.isclose(float(np.linalg.norm(a[0])), 1.0, rel_tol=1e-5)
    assert not a[2].any()  # no features: a zero vector, cosine 0 with everything
    assert e.name == "hash1-256"


def test_hashing_embedder_ranks_overlap_above_unrelated() -> None:
    e = HashingEmbedder()
    q, near, far = e.embed(["refund policy for annual plans",
                            "Annual plans can be refunded within 30 days",
                            "The customer likes dark mode"])
    assert float(q @ near) > 0.3 > float(q @ far)


@given(st.text(max_size=300))
def test_embedding_any_text_is_finite(text: str) -> None:
    v = HashingEmbedder(dim=64).embed_one(text)
    assert np.isfinite(v).all()
    n = float(np.linalg.norm(v))
    assert n == 0.0 or math.isclose(n, 1.0, rel_tol=1e-4)


def test_content_terms() -> None:
    assert content_terms("The user's Invoices were PAID") >= {"invoice", "paid"}
    assert "the" not in content_terms("The the THE")
    assert {"中文", "回复"} <= content_terms("用户偏好使用中文回复 🇨🇳")


def test_unknown_or_missing_embedders_fail_clearly() -> None:
    with pytest.raises(EmbedderUnavailable, match="unknown embedder"):
        load_embedder("word2vec")
    try:
        load_embedder("minilm")
    except EmbedderUnavailable as exc:  # the optional extra is not installed in CI
        assert "pip install" in str(exc)


@pytest.mark.parametrize("runtime", ["onnxruntime", "tensorrt"])
def test_a_minilm_runtime_not_offered_is_refused_in_one_line(runtime: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Only auto, openvino and numpy run minilm: any other IBEX_MEMORY_MINILM_RUNTIME is refused at
    start, in one line naming the setting and the values it takes, before any model is loaded."""
    from ibex_context.memory.embedders.config import EmbedderConfig
    from ibex_context.memory.service import server

    with pytest.raises(EmbedderUnavailable) as refused:
        load_embedder("minilm", EmbedderConfig(minilm_runtime=runtime))
    assert str(refused.value) == (f"IBEX_MEMORY_MINILM_RUNTIME={runtime}: not a minilm runtime; "
                                  "use one of auto, openvino, numpy")
    monkeypatch.setenv("IBEX_MEMORY_MINILM_RUNTIME", runtime)
    assert server._config() is None  # the service's start: exit status 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: IBEX_MEMORY_MINILM_RUNTIME: ")
    assert all(f"'{v}'" in line for v in ("auto", "openvino", "numpy")) and "onnxruntime" not in line


def test_per_record_memoises_by_identity_and_skips_large_records() -> None:
    from datetime import UTC, datetime

    from ibex_context.memory.store.records import MemoryRecord
    from ibex_context.memory.store.writes import per_record

    calls: list[str] = []

    @per_record
    def head(rec: MemoryRecord) -> str:
        calls.append(rec.memory_id)
        return rec.content[:5]

    def rec(mid: str, content: str) -> MemoryRecord:
        return MemoryRecord(memory_id=mid, content=content, category="fact", confidence=0.5,
                            created_at=datetime(2026, 1, 1, tzinfo=UTC))

    small, twin, big = rec("a", "hello world"), rec("a", "hello world"), rec("b", "x" * 5000)
    assert [head(small), head(small), head(twin), head(big), head(big)] == ["hello", "hello", "hello", "xxxxx", "xxxxx"]
    assert calls == ["a", "a", "b", "b"]  # an equal but distinct record is computed again; a large one each time


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0.0, 1.0)),
       st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-1.0, 1.0)), st.floats(0.0, 1.0),
       st.floats(0.0, 1.0), st.sampled_from(["lift", "convex", "rrf"]))
def test_every_fusion_rule_keeps_the_same_candidates_in_unit_range(
        text: dict[str, float], cosine: dict[str, float], cut: float, w: float, rule: Any) -> None:
    got = fuse(text, cosine, min_similarity=cut, text_weight=w, rule=rule)
    assert set(got) == set(fuse(text, cosine, min_similarity=cut))  # the rule ranks; it never filters
    for f in got.values():
        assert 0.0 <= f.relevance <= 1.0


def test_convex_and_rrf_fusion() -> None:
    text, cosine = {"a": 1.0, "b": 0.5}, {"a": 0.2, "b": 0.9, "c": 0.8}
    convex = fuse(text, cosine, min_similarity=0.5, text_weight=0.5, rule="convex")
    assert convex["a"].relevance == pytest.approx(0.6) and convex["c"].relevance == pytest.approx(0.4)
    rrf = fuse(text, cosine, min_similarity=0.5, text_weight=0.5, rule="rrf")
    # text order a, b; cosine order b, c, a: b is 2nd and 1st, a 1st and 3rd, c only 2nd by cosine
    assert rrf["b"].relevance == pytest.approx((0.5 / 62 + 0.5 / 61) * 61)
    assert rrf["a"].relevance == pytest.approx((0.5 / 61 + 0.5 / 63) * 61)
    assert rrf["c"].relevance == pytest.approx(0.5 / 62 * 61)
    assert rrf["b"].relevance > rrf["a"].relevance > rrf["c"].relevance
