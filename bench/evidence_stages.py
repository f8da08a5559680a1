"""``python -m bench.evidence_stages``: at which stage of a search each question's evidence is lost.

The conversation set (``bench.conversations``: 5 chats, 2,257 turns, 323 answerable questions) is
seeded into a fresh stack (embedded Redis, the memory service, a broker and one worker; MiniLM,
token states stored), and for every question the bench records whether an evidence turn is

- ``text``: among the full-text side's candidates (each question word's BM25 matches, the best
  ``IBEX_MEMORY_MAX_CANDIDATES`` by text score: ``memory.search.fulltext``), read from the engine;
- ``vectors``: among the vector query's ``IBEX_MEMORY_VECTOR_CANDIDATES`` nearest, read from the engine;
- ``pool``: in either (what a search fuses);
- ``fused@10``: among the first 10 by fused relevance (``memory.search.fusion``, the subject boost),
  the order the rerank starts from, computed here from the engine's replies;
- ``reranked pool``: among the ``IBEX_MEMORY_RERANK_DEPTH`` best the rerank compares (the kept
  candidates, and those under the cosine cutoff that join it: ``memory.search.rerank.widened``);
- ``search@10`` and ``answered``: among the first 10 and all the hits of the memory service's own
  search (``POST /v1/memories/search``, limit ``IBEX_COLD_LIMIT``: fused, reranked, composite);
- ``packed``: in what the worker packed for the question (an assembly through the broker), with the
  memory tokens packed.

A question's ``lost at`` is the first of pool, reranked pool, answered and packed its evidence is
missing from. The stages computed here follow the service's code paths from the same engine
replies, with the question embedded by this process (the same MiniLM graph); only ``search@10``,
``answered`` and ``packed`` are the services' own answers. ``--env K=V`` sets the stack's settings
(and the stages computed here read them too). Nothing is asserted.

    python -m bench.evidence_stages [--limit N] [--env IBEX_MEMORY_RERANK_DEPTH=50 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.conversations import (
    CATEGORIES,
    QUALITY_DEADLINES,
    ConvQuestion,
    PrecomputedEmbedder,
    embed_turns,
    load_set,
)
from bench.lib.percentiles import median
from bench.lib.stack import started_stack
from bench.lib.tables import table
from ibex_context.client.client import AsyncClient
from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.search.fulltext import FullText, Scope
from ibex_context.memory.search.fusion import boosted, fuse
from ibex_context.memory.search.index import index_name, knn_query, parse_reply, query_terms, search_args
from ibex_context.memory.search.rerank import widened
from ibex_context.memory.search.subjects import names, question_words, subject_of
from ibex_context.memory.search.terms import TermTable
from ibex_context.memory.service.config import MemoryConfig
from ibex_context.memory.service.seed import seed_records
from ibex_context.shared.config.settings import WorkerSettings
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.connect import async_client
from ibex_context.shared.stores.keys import memory_ids_key, memory_key_prefix, vector_field

STAGES = ("text", "vectors", "pool", "fused@10", "reranked pool", "search@10", "answered", "packed")
FUNNEL = ("pool", "reranked pool", "answered", "packed")  # each holds what reaches the next


@contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment while the settings are read."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _engine_stages(redis: Any, cfg: MemoryConfig, q: ConvQuestion, query_vec: np.ndarray,
                         subjects: Mapping[str, str | None], cutoff: float, emb: str) -> dict[str, set[str]]:
    """The candidate sets of one question's search, from the engine's replies (module docstring);
    ``emb``: the embedder's name, as its index and vector field are named."""
    org, agent = q.org_id, q.agent_id
    name, prefix, vfield = index_name(emb, org, agent), memory_key_prefix(org, agent), vector_field(emb)
    # No sample and a small agent: every question word is scanned in full, as the service does for
    # an agent of at most IBEX_MEMORY_TERM_SCAN_MAX memories (the conversations' are 400-500).
    text = FullText(TermTable(), Scope(emb, org, agent), query_terms(q.question), size=0, sample=(),
                    scan_max=cfg.term_scan_max, limit=cfg.max_candidates, now=0.0)
    commands = text.first()
    commands.append(("FT.SEARCH", name, *search_args(
        knn_query(org, agent, vfield, cfg.vector_candidates, exact=True), limit=cfg.vector_candidates,
        returns=("vd",), scored=False, params={"vec": query_vec.astype(np.float32).tobytes()}, sort_by="vd")))
    commands.append(("SCARD", memory_ids_key(org, agent)))
    async with redis.pipeline(transaction=False) as pipe:
        for args in commands:
            pipe.execute_command(*args)
        replies = await pipe.execute()
    text.read_first(replies[:-2], int(replies[-1]))
    text_of = text.scores(cfg.max_candidates)
    cosine = {f.memory_id: f.score for f in parse_reply(replies[-2], prefix, vfield, vector_query=True)}
    only_text = [m for m in text_of if m not in cosine]
    if only_text:
        async with redis.pipeline(transaction=False) as pipe:
            for m in only_text:
                pipe.hget(f"{prefix}{m}", vfield)
            for m, raw in zip(only_text, await pipe.execute(), strict=True):
                if raw:
                    cosine[m] = float(np.frombuffer(raw, dtype=np.float32) @ query_vec)
    kept = fuse(text_of, cosine, min_similarity=cutoff, text_weight=cfg.text_weight, rule=cfg.fusion)
    words = question_words(q.question)
    kept = boosted(kept, {m: names(words, subjects.get(f"{org}\0{agent}\0{m}")) for m in kept}, cfg.subject_boost)
    under = sorted(((c, m) for m, c in cosine.items() if m not in kept), key=lambda cm: (-cm[0], cm[1]))
    joined = widened(kept, under, min(cfg.rerank_min_candidates, cfg.rerank_depth)) if cfg.rerank_weight > 0 else {}
    pool = {**kept, **joined}
    order = sorted(pool, key=lambda m: (-pool[m].relevance, m))
    by_fused = sorted(kept, key=lambda m: (-kept[m].relevance, m))
    return {"text": set(text_of), "vectors": set(cosine) - set(only_text), "pool": set(text_of) | set(cosine),
            "fused@10": set(by_fused[:10]), "reranked pool": set(order[: cfg.rerank_depth])}


async def run(turns: list[dict[str, Any]], questions: list[ConvQuestion], extra_env: dict[str, str],
              timeout_s: float = 2.0) -> dict[str, Any]:
    """Seed the turns into a fresh stack and record every question's stages (module docstring)."""
    with _environ(extra_env):
        cfg, cold_limit = MemoryConfig(), WorkerSettings().cold_limit
    emb = load_embedder("minilm")
    texts = [t["content"] for t in turns]
    vectors, states = embed_turns(emb, texts)
    subjects = {f"{t['org_id']}\0{t['agent_id']}\0{t['memory_id']}": subject_of(t.get("subject"), t["content"])
                for t in turns}
    env = {**QUALITY_DEADLINES, "IBEX_MEMORY_EMBEDDER": "minilm", **extra_env}
    out: dict[str, Any] = {"questions": {}}
    log_dir = Path(f"/tmp/ibex-bench-evidence-{uuid.uuid4().hex[:8]}")
    with started_stack(workers=1, env=env, log_dir=log_dir, seed=False) as stack:
        redis = async_client(str(stack.redis_url))
        client = AsyncClient(stack.frontend)
        try:
            await seed_records(redis, turns, embedder=PrecomputedEmbedder(emb, texts, vectors, states), flush=True)
            await client.wait_connected(10.0)
            async with aiohttp.ClientSession(base_url=stack.memory_url) as http:
                for q in questions:
                    if q.category == "no-answer":
                        continue
                    headers = {"authorization": f"Bearer {mint_org_token(stack.secret, q.org_id)}"}
                    body = {"query": q.question, "agent_id": q.agent_id, "limit": cold_limit}
                    async with http.post("/v1/memories/search", json=body, headers=headers) as r:
                        hits = (await r.json())["memories"] if r.status == 200 else []
                    answered = [h["memory_id"] for h in hits]  # the search made the org's index first
                    query_vec = np.asarray(emb.embed_query(q.question), dtype=np.float32)
                    sets = await _engine_stages(redis, cfg, q, query_vec, subjects, emb.min_similarity, emb.name)
                    sets["search@10"], sets["answered"] = set(answered[:10]), set(answered)
                    resp = await client.assemble(org_id=q.org_id, agent_id=q.agent_id, model="gpt-4o",
                                                 query=q.question, timeout=timeout_s)
                    sets["packed"] = {p.memory_id for p in resp.packed}
                    found = {s: bool(q.evidence & sets[s]) for s in STAGES}
                    lost = next((s for s in FUNNEL if not found[s]), "-")
                    out["questions"][q.qid] = {"category": q.category, "found": found, "lost_at": lost,
                                               "packed_tokens": sum(p.tokens for p in resp.packed)}
        finally:
            await client.aclose()
            await redis.aclose()
    out["settings"] = {"max_candidates": cfg.max_candidates, "vector_candidates": cfg.vector_candidates,
                       "rerank_depth": cfg.rerank_depth, "rerank_weight": cfg.rerank_weight,
                       "rerank_min_candidates": cfg.rerank_min_candidates, "cold_limit": cold_limit}
    return out


def report(result: Mapping[str, Any]) -> list[str]:
    """Per category: the share of answerable questions whose evidence reaches each stage, where it
    was lost, and the memory tokens packed per question."""
    rows = []
    per_q: Mapping[str, Mapping[str, Any]] = result["questions"]
    for cat in (*CATEGORIES[:-1], "all answerable"):
        qs = [v for v in per_q.values() if cat in (v["category"], "all answerable")]
        if not qs:
            continue
        shares = [f"{statistics.fmean(float(v['found'][s]) for v in qs):.3f}" for s in STAGES]
        lost = {s: sum(1 for v in qs if v["lost_at"] == s) for s in FUNNEL}
        tokens = [v["packed_tokens"] for v in qs]
        rows.append([cat, len(qs), *shares, " / ".join(str(lost[s]) for s in FUNNEL),
                     f"{statistics.fmean(tokens):.0f} / {median(tokens):.0f}"])
    return [f"settings: {json.dumps(result['settings'])}", "",
            *table(["category", "n", *STAGES, "lost at pool / reranked pool / answered / packed",
                    "packed tokens mean / median"], rows)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.evidence_stages", description=__doc__.split("\n")[0])
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="a setting of the stack (repeatable)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions")
    ap.add_argument("--out", type=Path, default=None, help="also write the per-question stages here (JSON)")
    args = ap.parse_args(argv)
    turns, questions = load_set(limit=args.limit)
    result = asyncio.run(run(turns, questions, dict(kv.split("=", 1) for kv in args.env)))
    print("\n".join(report(result)))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
