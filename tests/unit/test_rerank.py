"""The late-interaction rerank's pure parts: the token-state codec, MaxSim, and the mix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.memory.embedders.token_states import (
    DIMS,
    ROW_BYTES,
    decode,
    decode_many,
    encode,
    project,
    rows_of,
    stored_bytes,
)
from ibex_context.memory.search.fusion import Fused
from ibex_context.memory.search.rerank import maxsim, rerank, stays, widened
from ibex_context.pipeline.decisions import retrieval_scores
from ibex_context.pipeline.selection.hits import to_hit
from ibex_context.pipeline.types import ScoredMemory


def _states(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, 384)).astype(np.float32)


def test_stored_states_round_trip_within_int8_error() -> None:
    raw = encode(_states(1, 9))
    assert len(raw) == stored_bytes(9) == 2 + 9 * ROW_BYTES
    got = decode(raw)
    assert got is not None and got.shape == (9, DIMS)
    assert np.abs(got - project(_states(1, 9))).max() < 0.01


@pytest.mark.parametrize("raw", [None, b"", b"\x01", b"\x01\x40", b"\x02\x40" + bytes(ROW_BYTES), "text", 5])
def test_absent_or_foreign_states_decode_to_none(raw: object) -> None:
    assert decode(raw) is None


@given(st.binary(max_size=400))
@settings(max_examples=200, deadline=None)
def test_decode_is_total(raw: bytes) -> None:
    got = decode(raw)
    assert got is None or (got.ndim == 2 and got.shape[1] == DIMS and np.isfinite(got).all())


def test_a_truncated_value_is_refused() -> None:
    assert decode(encode(_states(2, 4))[:-1]) is None


def test_maxsim_is_the_mean_of_each_query_tokens_best_cosine() -> None:
    q = project(_states(3, 5))
    docs = [project(_states(4 + i, n)) for i, n in enumerate((1, 7, 3))]
    want = [float((q @ d.T).max(axis=1).mean()) for d in docs]
    assert np.allclose(maxsim(q, np.concatenate(docs), [1, 7, 3]), want, atol=1e-6)


def test_many_values_decode_as_each_does() -> None:
    raws = [encode(_states(5 + i, n)) for i, n in enumerate((3, 1, 6))]
    got = decode_many(raws, [rows_of(r) for r in raws])
    assert got is not None and np.array_equal(got, np.concatenate([decode(r) for r in raws]))
    assert [rows_of(r) for r in (*raws, raws[0][:-1], None)] == [3, 1, 6, 0, 0]


def _fused(*relevance: float) -> dict[str, Fused]:
    return {f"m{i}": Fused(r, 0.5, r) for i, r in enumerate(relevance)}


def test_weight_zero_or_no_question_states_change_nothing() -> None:
    fused = _fused(0.9, 0.5, 0.3)
    states = {m: encode(_states(i, 4)) for i, m in enumerate(fused)}
    q = project(_states(9, 5))
    assert rerank(fused, q, states, weight=0.0) == fused
    assert rerank(fused, None, states, weight=0.5) == fused


def test_the_mix_reorders_and_keeps_memories_without_states_and_the_floor() -> None:
    q = project(_states(9, 5))
    fused = _fused(0.6, 0.55, 0.5, 0.16)
    states: dict[str, object] = {"m0": encode(_states(20, 6)), "m1": encode(_states(9, 5)),  # m1 says the question
                                 "m2": None, "m3": encode(_states(21, 6))}
    out = rerank(fused, q, states, weight=0.9, floor=0.15)
    assert out["m1"].relevance > out["m0"].relevance  # the memory whose tokens match the question's rises
    assert out["m2"] == fused["m2"]  # no states: its relevance and no rerank score
    assert out["m3"].relevance >= 0.15  # never taken under the floor it was above
    damaged = dict(states, m0=bytes(encode(_states(20, 6))[:-2]) + b"\xff\x7f")  # its last scale is NaN
    again = rerank(fused, q, damaged, weight=0.9, floor=0.15)
    assert again["m0"] == fused["m0"] and again["m1"].rerank is not None
    assert all(out[m].rerank is not None for m in ("m0", "m1", "m3"))


def test_the_rerank_score_reaches_the_decisions() -> None:
    hit = to_hit({"memory_id": "m", "content": "x", "category": "note", "similarity": 0.5, "confidence": 0.8,
                  "rank": 1, "text_score": 0.1, "vector_score": 0.4, "boost": 0.0, "rerank_score": 0.7}, "cold")
    assert retrieval_scores(ScoredMemory(hit=hit, tokens=1, composite_score=0.5)) == {
        "text": 0.1, "vector": 0.4, "boost": 0.0, "rerank": 0.7}


def test_candidates_under_the_cutoff_join_the_rerank_up_to_the_minimum() -> None:
    kept = _fused(0.9, 0.5)
    under = [(0.18, "u0"), (0.12, "u1"), (0.05, "u2")]  # most similar first
    assert widened(kept, under, 0) == {} and widened(kept, under, 2) == {}
    joined = widened(kept, under, 4)
    assert list(joined) == ["u0", "u1"]  # the most similar first, until 4 candidates
    assert joined["u0"] == Fused(0.18, 0.0, 0.18)  # at its cosine, no text score, not yet reranked
    assert list(widened({}, under, 10)) == ["u0", "u1", "u2"]


def test_a_joined_candidate_stays_only_if_reranked_to_the_cutoff() -> None:
    reranked = {"m0": Fused(0.1, 0.5, 0.1, rerank=0.2), "u0": Fused(0.25, 0.0, 0.18, rerank=0.9),
                "u1": Fused(0.19, 0.0, 0.12, rerank=0.4)}
    joined = {m: reranked[m] for m in ("u0", "u1")}
    assert set(stays(reranked, joined, 0.2)) == {"m0", "u0"}  # a kept candidate is never dropped here
    assert stays(reranked, {}, 0.2) == reranked


def test_the_rerank_lifts_a_joined_candidate_whose_tokens_say_the_question() -> None:
    q = project(_states(9, 5))
    kept = _fused(0.6, 0.55, 0.5)
    joined = widened(kept, [(0.12, "u0"), (0.11, "u1")], 5)
    states: dict[str, object] = {"m0": encode(_states(20, 6)), "m1": encode(_states(21, 6)),
                                 "m2": encode(_states(22, 6)), "u0": encode(_states(9, 5)),
                                 "u1": encode(_states(23, 6))}
    out = stays(rerank({**kept, **joined}, q, states, weight=0.9, floor=0.15), joined, 0.2)
    assert "u0" in out and out["u0"].relevance >= 0.2 and out["u0"].rerank is not None
    assert "u1" not in out or out["u1"].relevance >= 0.2
