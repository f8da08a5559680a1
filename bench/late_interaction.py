"""``python -m bench.late_interaction``: what the late-interaction rerank (``memory.search.rerank``) earns
on the conversation set, offline, and what its token states cost.

The conversation set (``bench.conversations``) is seeded into a real stack (embedded Redis and the
memory service with minilm, its rerank off) and every answerable question is searched as the
worker searches (``limit`` 50, the embedder's cutoff): the stack's own top 50 by composite. Then,
offline, each candidate gets a MaxSim score: the mean over the question's MiniLM token states of
the best cosine with the memory's token states (ColBERT's late interaction; [CLS] and [SEP] left
out), both from the numpy reference pass. The rerank orders the 50 by ``(1 - a) · z(composite) +
a · z(maxsim)`` (each standardised over the 50). ``a`` is fitted on one half of the chats (1, 3,
5 or 2, 4) by hit@10 + hit@1 and scored on the other, both ways. Memory token states are tried in
float32 and as int8 (a scale per token) after a PCA to 64 dimensions fitted on these turns (no
labels, but the evaluation's own text: an upper bound), and ``--projection LABEL FILE`` scores the
projections ``memory/data/fit_token_projection.py`` writes (``random``: no fit; ``pca``: fitted on
the documentation's text), as the service stores them. Per variant: the bytes a memory would
store, and the CPU of one MaxSim over 50 candidates.

``--redis-bytes`` instead writes the 2,257 turns to a fresh embedded Redis with and without their
token states (the service's own seed path) and reports ``used_memory`` growth and the storage
charge per memory. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from redis.asyncio import Redis

from bench.conversations import QUALITY_DEADLINES, ConvQuestion, judge, load_set
from bench.lib.stack import started_stack
from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.embedders.minilm import HIDDEN, LAYERS, MiniLM, MiniLMEmbedder, _layer_norm, right_padded
from ibex_context.memory.service.seed import seed_records
from ibex_context.shared.security.tenancy import mint_org_token

Array = np.ndarray[Any, Any]
HALVES = {"A": frozenset({1, 3, 5}), "B": frozenset({2, 4})}
ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
VARIANTS = (("fp32", HIDDEN, False), ("int8-64 pca-eval", 64, True))
Candidates = dict[str, list[tuple[str, float]]]  # qid -> (memory_id, composite), the stack's order


async def stack_candidates(turns: list[dict[str, Any]], questions: Sequence[ConvQuestion]) -> Candidates:
    """The memory service's top 50 per question, on a fresh stack seeded with ``turns``."""
    env = {**QUALITY_DEADLINES, "IBEX_MEMORY_EMBEDDER": "minilm", "IBEX_MEMORY_RERANK_WEIGHT": "0"}
    out: Candidates = {}
    with started_stack(workers=1, env=env, log_dir=Path(f"/tmp/ibex-bench-li-{uuid.uuid4().hex[:8]}"),
                       seed=False) as stack:
        redis = Redis.from_url(str(stack.redis_url))
        try:
            await seed_records(redis, turns, embedder=load_embedder("minilm"), flush=True)
        finally:
            await redis.aclose()
        async with aiohttp.ClientSession(base_url=stack.memory_url) as http:
            for q in questions:
                headers = {"authorization": f"Bearer {mint_org_token(stack.secret, q.org_id)}"}
                body = {"query": q.question, "agent_id": q.agent_id, "limit": 50}
                async with http.post("/v1/memories/search", json=body, headers=headers) as resp:
                    doc = await resp.json()
                out[q.qid] = [(m["memory_id"], float(m["composite"])) for m in doc["memories"]]
    return out


def token_states(model: MiniLM, texts: Sequence[str]) -> list[Array]:
    """Each text's last-layer token states (unit rows, [CLS] and [SEP] left out): the pass
    ``MiniLM.encode_ids`` makes before pooling, in length-sorted batches of 32."""
    encs = model.tokenizer.encode_batch(list(texts))
    order = sorted(range(len(encs)), key=lambda i: len(encs[i].ids))
    out: list[Array] = [np.zeros((0, HIDDEN), dtype=np.float32)] * len(encs)
    w = model.w
    for start in range(0, len(order), 32):
        chunk = order[start:start + 32]
        ids = [list(encs[i].ids) for i in chunk]
        tokens, mask = right_padded(ids, np.float32)
        length = tokens.shape[1]
        x = (w["embeddings.word_embeddings.weight"][tokens] + w["embeddings.position_embeddings.weight"][:length]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        bias = ((1.0 - mask) * -1e9)[:, None, None, :]
        for layer in range(LAYERS):
            x = model._layer(layer, x, bias)
        for j, i in enumerate(chunk):
            v = x[j, 1:len(ids[j]) - 1] if len(ids[j]) > 2 else x[j, :len(ids[j])]
            out[i] = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    return out


def compress(states: dict[str, Array], dims: int, quantise: bool, basis: tuple[Array, Array]) -> dict[str, Array]:
    """Token states as a memory would store them: projected to ``dims`` (PCA ``basis``), unit rows,
    int8 with a scale per token when ``quantise`` (returned dequantised, as a search reads them)."""
    mean, vt = basis
    out: dict[str, Array] = {}
    for key, v in states.items():
        if dims < HIDDEN:
            v = (v - mean) @ vt[:dims].T
        v = v / np.linalg.norm(v, axis=1, keepdims=True)
        if quantise:
            scale = np.abs(v).max(1, keepdims=True) / 127.0
            v = np.round(v / scale).astype(np.int8).astype(np.float32) * scale
        out[key] = v.astype(np.float32)
    return out


def _z(values: Sequence[float]) -> Array:
    a = np.asarray(values, dtype=np.float64)
    sd = a.std()
    return (a - a.mean()) / sd if sd > 1e-12 else np.zeros_like(a)


def score(cands: Candidates, memories: dict[str, Array], queries: dict[str, Array], alpha: float,
          questions: Sequence[ConvQuestion]) -> dict[str, float]:
    """Mean hit@1, hit@10 and recall@10 of the reranked candidates."""
    rows = []
    for q in questions:
        found = cands.get(q.qid, [])
        ids = [m for m, _ in found]
        if not ids:
            rows.append(judge([], q.evidence))
            continue
        maxsim = [float((queries[q.qid] @ memories[m].T).max(1).mean()) for m in ids]
        fused = (1.0 - alpha) * _z([c for _, c in found]) + alpha * _z(maxsim)
        order = np.lexsort((np.arange(len(ids)), -fused))
        rows.append(judge([ids[i] for i in order], q.evidence))
    return {k: float(np.mean([r[k] for r in rows])) for k in ("hit@1", "hit@10", "recall@10")}


def _chat(q: ConvQuestion) -> int:
    return int(q.qid.split("-")[0][1:])


def _fmt(m: dict[str, float]) -> str:
    return f"{m['hit@1']:.3f} / {m['hit@10']:.3f} / {m['recall@10']:.3f}"


def report(cands: Candidates, memories: dict[str, Array], queries: dict[str, Array], name: str,
           questions: Sequence[ConvQuestion]) -> list[str]:
    """One line per held-out half: the fitted weight, before and after (hit@1 / hit@10 / recall@10)."""
    lines = []
    for fit, test in (("A", "B"), ("B", "A")):
        fq = [q for q in questions if _chat(q) in HALVES[fit]]
        tq = [q for q in questions if _chat(q) in HALVES[test]]
        fits = {a: score(cands, memories, queries, a, fq) for a in ALPHAS}
        alpha = max(ALPHAS, key=lambda a: fits[a]["hit@10"] + fits[a]["hit@1"])
        lines.append(f"| {name} | {fit} -> {test} | {alpha} | {_fmt(score(cands, memories, queries, 0.0, tq))} | "
                     f"{_fmt(score(cands, memories, queries, alpha, tq))} |")
    return lines


def _maxsim_ms(cands: Candidates, memories: dict[str, Array], queries: dict[str, Array], qid: str) -> float:
    mats, query = [memories[m] for m, _ in cands[qid]], queries[qid]
    t0 = time.perf_counter()
    for _ in range(200):
        best = [float((query @ mat.T).max(1).mean()) for mat in mats]
    assert len(best) == len(mats)
    return (time.perf_counter() - t0) / 200 * 1e3


async def _redis_bytes(turns: list[dict[str, Any]], vectors: Array, states: list[bytes | None] | None
                      ) -> tuple[float, float]:
    """Seed ``turns`` (with their token states, or without) into a fresh embedded Redis: the growth
    of ``used_memory`` and the storage charge, each per memory."""
    from bench.conversations import PrecomputedEmbedder
    from ibex_context.memory.embedded_redis.server import EmbeddedRedis
    from ibex_context.shared.stores import storage

    texts = [t["content"] for t in turns]
    server = EmbeddedRedis().start()
    try:
        redis = Redis.from_url(server.url)
        try:
            before = int((await redis.info("memory"))["used_memory"])
            await seed_records(redis, turns, embedder=PrecomputedEmbedder(load_embedder("minilm"), texts, vectors,
                                                                          states), flush=True)
            used = int((await redis.info("memory"))["used_memory"]) - before
            charged = sum([await storage.usage(redis, org) for org in sorted({t["org_id"] for t in turns})])
        finally:
            await redis.aclose()
    finally:
        server.close()
    return used / len(turns), charged / len(turns)


def redis_bytes() -> int:
    """``--redis-bytes``: the conversation turns written with and without their token states."""
    from bench.conversations import embed_turns

    turns, _ = load_set()
    vectors, states = embed_turns(load_embedder("minilm"), [t["content"] for t in turns])
    print("| memories stored | Redis bytes per memory (used_memory growth) | charged per memory |\n| --- | --- | --- |")
    for label, with_states in (("without token states", None), ("with token states", states)):
        used, charged = asyncio.run(_redis_bytes(turns, vectors, with_states))
        print(f"| {label} | {used:,.0f} | {charged:,.0f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.late_interaction", description=__doc__.split("\n")[0])
    ap.add_argument("--projection", nargs=2, action="append", default=[], metavar=("LABEL", "NPZ"),
                    help="also score int8 states projected by this file (memory/data/fit_token_projection.py)")
    ap.add_argument("--redis-bytes", action="store_true",
                    help="only measure what Redis holds per conversation turn with and without its token states")
    args = ap.parse_args(argv)
    if args.redis_bytes:
        return redis_bytes()
    turns, questions = load_set()
    answerable = [q for q in questions if q.category != "no-answer"]
    cands = asyncio.run(stack_candidates(turns, answerable))
    embedder = MiniLMEmbedder()
    embedder.load()
    states = dict(zip([t["memory_id"] for t in turns], token_states(embedder.model, [t["content"] for t in turns]),
                      strict=True))
    queries = dict(zip([q.qid for q in answerable], token_states(embedder.model, [q.question for q in answerable]),
                       strict=True))
    every = np.concatenate(list(states.values()))
    mean = every.mean(0)
    basis = (mean, np.linalg.svd(every[::7] - mean, full_matrices=False)[2])
    tokens = float(np.mean([len(v) for v in states.values()]))
    print(f"{len(answerable)} answerable questions, {len(turns)} turns, {tokens:.1f} tokens per turn\n")
    print("| states | fit -> held out | a | before: hit@1 / hit@10 / recall@10 | after |")
    print("| --- | --- | --- | --- | --- |")
    costs = []
    for name, dims, quantise in VARIANTS:
        mems = compress(states, dims, quantise, basis)
        qs = compress(queries, dims, False, basis)
        print("\n".join(report(cands, mems, qs, name, answerable)))
        per_token = dims * (1 if quantise else 4) + (2 if quantise else 0)  # int8 rows carry an fp16 scale
        costs.append(f"| {name} | {tokens * per_token:.0f} | {_maxsim_ms(cands, mems, qs, answerable[0].qid):.3f} |")
    for label, path in args.projection:
        with np.load(path) as z:
            shipped = (np.asarray(z["centre"]), np.asarray(z["basis"]).T)
        dims = shipped[1].shape[0]
        mems, qs = compress(states, dims, True, shipped), compress(queries, dims, False, shipped)
        print("\n".join(report(cands, mems, qs, f"int8-{dims} {label}", answerable)))
    print("\n| states | bytes per memory (mean) | CPU ms per MaxSim over 50 candidates |\n| --- | --- | --- |")
    print("\n".join(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
