"""``bench.late_interaction``'s pure parts: compressed token states and the MaxSim rerank's order."""

from __future__ import annotations

import numpy as np

from bench.conversations import ConvQuestion
from bench.late_interaction import compress, score

DIM = 384


def _unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_int8_states_stay_close_to_the_float_ones_and_pca_cuts_dimensions() -> None:
    rng = np.random.default_rng(7)
    states = {"m1": _unit_rows(rng, 5), "m2": _unit_rows(rng, 3)}
    every = np.concatenate(list(states.values()))
    basis = (every.mean(0), np.linalg.svd(every - every.mean(0), full_matrices=False)[2])
    full = compress(states, DIM, True, basis)
    assert full["m1"].shape == (5, DIM)
    assert np.allclose(full["m1"], states["m1"], atol=0.01)  # one scale per token: ~1/254 of the largest
    small = compress(states, 4, True, basis)
    assert small["m2"].shape == (3, 4)
    assert np.allclose(np.linalg.norm(small["m2"], axis=1), 1.0, atol=0.02)


def test_the_weight_moves_the_order_from_the_composite_to_maxsim() -> None:
    rng = np.random.default_rng(3)
    query = _unit_rows(rng, 2)
    near = np.concatenate([query, _unit_rows(rng, 1)])  # holds the question's own token states
    memories = {"far": _unit_rows(rng, 3), "near": near, "other": _unit_rows(rng, 3)}
    cands = {"q1": [("far", 0.9), ("other", 0.5), ("near", 0.4)]}  # the stack's order, by composite
    q = ConvQuestion("c1-q1", "org", "agent", "single-hop", "?", frozenset({"near"}))
    cands = {q.qid: cands["q1"]}
    queries = {q.qid: query}
    assert score(cands, memories, queries, 0.0, [q]) == {"hit@1": 0.0, "hit@10": 1.0, "recall@10": 1.0}
    assert score(cands, memories, queries, 1.0, [q])["hit@1"] == 1.0
    assert score({}, memories, queries, 0.5, [q]) == {"hit@1": 0.0, "hit@10": 0.0, "recall@10": 0.0}
