"""``python -m bench.retrieval``: selection quality on the labelled questions.

``--suite conversations`` runs the long-conversation set instead (``bench.conversations``: the stack
beside plain BM25 and dense over the same turns); the demo questions below are the default suite.

For each embedder (``--embedders``) the whole stack is started (embedded Redis, the memory
service with ``IBEX_MEMORY_EMBEDDER``, a broker and one worker; ``bench.lib.stack.started_stack``) and
the demo data is seeded with the same embedder. Every question of ``bench/data/retrieval_eval.jsonl``
is then assembled through the broker with the client library (``gpt-4o``, the ``make run`` demo
model), once per scoring rule (``--rules``, sent as ``options.score``) and cosine cutoff
(``--cutoffs``, the worker's ``IBEX_COLD_MIN_SIMILARITY``: one stack per cutoff).

The ranking judged is the packed memories by the packer's score (highest first, memory_id on
ties): what the model reads first. Per question: recall@5, recall@10, recall of all packed, the
reciprocal rank of the first relevant memory, nDCG@10 (binary gains). Questions labelled ``none``
have no answer: their row counts the cold hits packed (fewer is better). Reworded questions are
checked to share no content term with their answers (``memory.embedders.embed.content_terms``); a label that
names no memory, or more than one, fails the run.

The memory service's CPU (``bench.lib.cpu``) is read around the assemblies (hot + search per
assembly) and around a loop of direct searches. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median
from bench.lib.stack import started_stack
from bench.lib.tables import table
from ibex_context.client.client import AsyncClient
from ibex_context.memory.embedders.embed import content_terms
from ibex_context.memory.service.seed import DEMO_FILE, derived_memory_id
from ibex_context.shared.security.tenancy import mint_org_token

EVAL_FILE = Path(__file__).resolve().parent / "data" / "retrieval_eval.jsonl"


@dataclass(frozen=True, slots=True)
class Question:
    qid: str
    org_id: str
    agent_id: str
    kind: str
    question: str
    relevant: frozenset[str]  # memory ids


def load_questions(path: Path = EVAL_FILE, demo: Path = DEMO_FILE) -> list[Question]:
    """The labelled questions with each content prefix resolved to exactly one memory id."""
    memories: dict[tuple[str, str], list[str]] = {}
    for line in demo.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("kind", "memory") == "memory":
            memories.setdefault((rec["org_id"], rec["agent_id"]), []).append(rec["content"])
    out: list[Question] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        q = json.loads(line)
        contents = memories.get((q["org_id"], q["agent_id"]), [])
        ids: set[str] = set()
        for prefix in q["relevant"]:
            hits = [c for c in contents if c.startswith(prefix)]
            if len(hits) != 1:
                raise ValueError(f"{q['id']}: label {prefix!r} names {len(hits)} memories of "
                                 f"{q['org_id']}/{q['agent_id']}, not exactly one")
            ids.add(derived_memory_id(q["org_id"], q["agent_id"], hits[0]))
            if q["kind"] == "reworded" and content_terms(q["question"]) & content_terms(hits[0]):
                shared = sorted(content_terms(q["question"]) & content_terms(hits[0]))
                raise ValueError(f"{q['id']}: reworded question shares {shared} with its answer")
        out.append(Question(q["id"], q["org_id"], q["agent_id"], q["kind"], q["question"], frozenset(ids)))
    return out


def judge(ranking: Sequence[str], relevant: frozenset[str]) -> dict[str, float]:
    """recall@5, recall@10, recall of all packed, reciprocal rank, nDCG@10 of one ranking."""
    n = len(relevant)
    rr = next((1.0 / (i + 1) for i, m in enumerate(ranking) if m in relevant), 0.0)
    dcg = sum(1.0 / math.log2(i + 2) for i, m in enumerate(ranking[:10]) if m in relevant)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(n, 10)))
    return {
        "r@5": len(relevant & set(ranking[:5])) / n,
        "r@10": len(relevant & set(ranking[:10])) / n,
        "r_packed": len(relevant & set(ranking)) / n,
        "mrr": rr,
        "ndcg@10": dcg / ideal,
    }


@dataclass
class RunResult:
    """Metrics of one (embedder, cutoff, rule) over every question."""

    per_question: dict[str, dict[str, float]] = field(default_factory=dict)
    none_cold: list[int] = field(default_factory=list)
    errors: int = 0
    late: dict[str, int] = field(default_factory=dict)  # branch -> assemblies where it did not succeed
    first: dict[str, list[str]] = field(default_factory=dict)  # qid -> top 3 packed contents


# Named weight sets for ``--rules composite/<name>``; plain "composite" uses the packer's defaults.
WEIGHTS = {"spec": (0.40, 0.25, 0.20, 0.10, 0.05), "rel70": (0.70, 0.10, 0.10, 0.05, 0.05),
           "rel85": (0.85, 0.05, 0.05, 0.025, 0.025)}


def _options(rule: str) -> dict[str, Any]:
    """``composite``, ``interim``, or ``composite/<WEIGHTS key>``: the request's score options."""
    name, _, weights = rule.partition("/")
    options: dict[str, Any] = {} if name == "default" else {"score": name}
    if WEIGHTS.get(weights):
        options["weights"] = dict(zip(("relevance", "recency", "usefulness", "confidence", "access"),
                                      WEIGHTS[weights], strict=True))
    return options


async def _assemble_all(client: AsyncClient, questions: list[Question], rule: str) -> RunResult:
    res = RunResult()
    for q in questions:
        options = _options(rule)
        try:
            resp = await client.assemble(org_id=q.org_id, agent_id=q.agent_id, model="gpt-4o", query=q.question,
                                         timeout=2.0, options=options)
        except Exception as exc:
            res.errors += 1
            print(f"  {q.qid}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        for name, outcome in resp.branches.items():
            if outcome.status not in ("success", "skipped"):
                res.late[name] = res.late.get(name, 0) + 1
        packed = sorted(resp.packed, key=lambda p: (-p.score, p.memory_id))
        ranking = [p.memory_id for p in packed]
        if q.kind == "none":
            res.none_cold.append(sum(1 for p in packed if p.source == "cold"))
        else:
            res.per_question[q.qid] = judge(ranking, q.relevant)
        res.first[q.qid] = ranking[:3]
    return res


async def _search_cpu(url: str, secret: str, questions: list[Question], pid: int, rounds: int) -> float:
    """Memory-service CPU (ms) per direct search, over ``rounds`` passes of every question."""
    async with aiohttp.ClientSession(base_url=url) as http:
        async def one(q: Question, n: int = 0) -> None:
            headers = {"authorization": f"Bearer {mint_org_token(secret, q.org_id)}"}
            # A fresh text each round: the service caches query vectors, a bench must not measure the cache.
            body = {"query": f"{q.question} ({n})", "agent_id": q.agent_id, "limit": 50, "min_similarity": 0.0}
            async with http.post("/v1/memories/search", json=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"search answered {r.status}")

        for q in questions:  # warm the index cache and the embedder
            await one(q)
        c0 = cpu_seconds(pid)
        for n in range(1, rounds + 1):
            for q in questions:
                await one(q, n)
        return (cpu_seconds(pid) - c0) / (rounds * len(questions)) * 1e3


def summarize(res: RunResult, questions: list[Question], kinds: Sequence[str] | None = None) -> dict[str, float]:
    keep = {q.qid for q in questions if kinds is None or q.kind in kinds}
    rows = [m for qid, m in res.per_question.items() if qid in keep]
    if not rows:
        return {}
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


async def _run_stack(embedder: str, cutoff: float | None, rules: list[str], questions: list[Question],
                     search_rounds: int, extra_env: dict[str, str]) -> dict[str, Any]:
    """``cutoff`` None: the worker names none, so the embedder's own applies (as a stack runs by default)."""
    env = {"IBEX_MEMORY_EMBEDDER": embedder, **extra_env}
    if cutoff is not None:
        env["IBEX_COLD_MIN_SIMILARITY"] = str(cutoff)
    log_dir = Path(f"/tmp/ibex-bench-retrieval-{uuid.uuid4().hex[:8]}")
    os.environ["IBEX_MEMORY_EMBEDDER"] = embedder  # the seed tool embeds with the service's embedder
    with started_stack(workers=1, env=env, log_dir=log_dir, seed=True) as stack:
        assert stack.memory is not None
        pid = stack.memory.pid
        out: dict[str, Any] = {"embedder": embedder, "cutoff": "own" if cutoff is None else cutoff, "rules": {}}
        client = AsyncClient(stack.frontend)
        await client.wait_connected(10.0)
        try:
            for rule in rules:
                await _assemble_all(client, questions[:5], rule)  # warm-up
                c0 = cpu_seconds(pid)
                t0 = time.perf_counter()
                res = await _assemble_all(client, questions, rule)
                wall = time.perf_counter() - t0
                out["rules"][rule] = {"result": res, "mem_cpu_ms": (cpu_seconds(pid) - c0) / len(questions) * 1e3,
                                      "wall_ms": wall / len(questions) * 1e3}
        finally:
            await client.aclose()
        out["search_cpu_ms"] = await _search_cpu(stack.memory_url, stack.secret, questions, pid, search_rounds)
    return out


async def _scale(n: int, embedder: str, queries: list[Question], rounds: int) -> list[list[Any]]:
    """Search CPU with ``n`` memories in one agent: demo texts (numbered, so terms repeat as in real
    data) with random unit vectors (the search's work does not depend on what the vectors say)."""
    from redis.asyncio import Redis

    from ibex_context.memory.embedders.embed import load_embedder
    from ibex_context.memory.store.records import MemoryRecord
    from ibex_context.memory.store.writes import NewMemory, write_memories

    dim = load_embedder(embedder).dim
    name = load_embedder(embedder).name
    texts = [json.loads(line)["content"] for line in DEMO_FILE.read_text(encoding="utf-8").splitlines()
             if json.loads(line).get("kind", "memory") == "memory"]
    rng = np.random.default_rng(7)

    async def random_vectors(batch: Sequence[str]) -> Any:
        v = rng.standard_normal((len(batch), dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    now = datetime.now(UTC)
    items = [NewMemory("scale", "agent", MemoryRecord(
        memory_id=f"s{i:07d}", content=f"{texts[i % len(texts)]} (#{i})", category="fact", confidence=0.8,
        usefulness=0.5, access_count=i % 50, created_at=now - timedelta(days=i % 400), salience=0.5),
        hot=i < 20) for i in range(n)]
    env = {"IBEX_MEMORY_EMBEDDER": embedder}
    log_dir = Path(f"/tmp/ibex-bench-scale-{uuid.uuid4().hex[:8]}")
    rows: list[list[Any]] = []
    with started_stack(workers=1, env=env, log_dir=log_dir, seed=False) as stack:
        assert stack.memory is not None and stack.redis_url
        redis = Redis.from_url(stack.redis_url)
        t0 = time.perf_counter()
        await write_memories(redis, items, embedder_name=name, embed=random_vectors)
        await redis.aclose()
        print(f"wrote {n} memories in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        pid = stack.memory.pid
        async with aiohttp.ClientSession(base_url=stack.memory_url) as http:
            headers = {"authorization": f"Bearer {mint_org_token(stack.secret, 'scale')}"}
            async def one(body: dict[str, Any]) -> float:
                t = time.perf_counter()
                async with http.post("/v1/memories/search", json=body, headers=headers) as resp:
                    await resp.read()
                return (time.perf_counter() - t) * 1e3

            build = await one({"query": "warm up", "agent_id": "agent", "limit": 50})
            print(f"first search (decodes and indexes {n} memories): {build:.0f} ms", file=sys.stderr)
            for cutoff in (0.0, 0.3):
                c0 = cpu_seconds(pid)
                walls = [await one({"query": f"{q.question} [{r}-{cutoff}]", "agent_id": "agent", "limit": 50,
                                    "min_similarity": cutoff}) for r in range(rounds) for q in queries]
                cpu = (cpu_seconds(pid) - c0) / len(walls) * 1e3
                walls.sort()
                rows.append([n, embedder, cutoff, len(walls), f"{cpu:.2f}", f"{median(walls):.2f}",
                             f"{walls[int(0.9 * (len(walls) - 1))]:.2f}", f"{walls[int(0.99 * (len(walls) - 1))]:.2f}"])
    return rows


def _print(runs: list[dict[str, Any]], questions: list[Question]) -> None:
    head = ["embedder", "cutoff", "rule", "group", "n", "recall@5", "recall@10", "recall packed", "MRR", "nDCG@10"]
    rows: list[list[Any]] = []
    groups: list[tuple[str, Sequence[str] | None]] = [
        ("all answerable", None), ("reworded", ["reworded"]), ("multilingual", ["multilingual"]),
        ("direct+multi", ["direct", "multi"]), ("demo", ["demo"])]
    for run in runs:
        for rule, r in run["rules"].items():
            for name, kinds in groups:
                s = summarize(r["result"], questions, kinds)
                n = sum(1 for q in questions if q.kind != "none" and (kinds is None or q.kind in kinds))
                rows.append([run["embedder"], run["cutoff"], rule, name, n,
                             *(f"{s.get(k, 0.0):.3f}" for k in ("r@5", "r@10", "r_packed", "mrr", "ndcg@10"))])
    print("\n".join(table(head, rows)))
    head2 = ["embedder", "cutoff", "rule", "no-answer: cold hits packed (mean)", "errors", "branches late/failed",
             "memory-service CPU ms / assembly", "wall ms / assembly", "memory-service CPU ms / search"]
    rows2 = []
    for run in runs:
        for rule, r in run["rules"].items():
            res = r["result"]
            rows2.append([run["embedder"], run["cutoff"], rule,
                          f"{statistics.fmean(res.none_cold):.1f}" if res.none_cold else "-", res.errors,
                          " ".join(f"{k}:{v}" for k, v in sorted(res.late.items())) or "-",
                          f"{r['mem_cpu_ms']:.2f}", f"{r['wall_ms']:.2f}", f"{run['search_cpu_ms']:.2f}"])
    print()
    print("\n".join(table(head2, rows2)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.retrieval", description=__doc__.split("\n")[0])
    ap.add_argument("--embedders", default="hash", help="comma-separated IBEX_MEMORY_EMBEDDER values")
    ap.add_argument("--cutoffs", default="own",
                    help="comma-separated cosine cutoffs (IBEX_COLD_MIN_SIMILARITY); 'own': unset, each "
                         "embedder's own (default)")
    ap.add_argument("--rules", default="default", help="comma-separated scoring rules (options.score)")
    ap.add_argument("--search-rounds", type=int, default=3, help="passes of direct searches for the CPU figure")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment for the stack, e.g. IBEX_HOT_TIMEOUT_MS=45 (repeatable)")
    ap.add_argument("--scale", default="", help="comma-separated memory counts for the search-CPU-at-scale table "
                                                 "(e.g. 348,100000); skips the quality runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the per-question metrics here")
    ap.add_argument("--suite", choices=("demo", "conversations"), default="demo",
                    help="demo: the labelled demo questions (default); conversations: the long two-person chats of "
                         "bench/data/conversations.jsonl, the stack beside plain BM25 and dense (bench.conversations)")
    ap.add_argument("--limit", type=int, default=None, help="conversations: only the first N questions")
    ap.add_argument("--sessions", type=int, default=None,
                    help="conversations: only each chat's first N sessions (and the questions they answer)")
    ap.add_argument("--conversations", default=None, help="conversations: comma-separated chat numbers (1-5)")
    ap.add_argument("--out", type=Path, default=None, help="conversations: write summary, per-question metrics "
                                                           "and rankings as JSON here")
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="conversations: the stack on an embedded Redis Cluster of N primaries + N replicas")
    args = ap.parse_args(argv)
    if args.suite == "conversations":
        from bench import conversations

        chats = [int(c) for c in args.conversations.split(",")] if args.conversations else None
        return conversations.main(limit=args.limit, out=args.out, env=args.env, sessions=args.sessions,
                                  conversations=chats, redis_cluster=args.redis_cluster)
    questions = load_questions()
    kinds = statistics.multimode([q.kind for q in questions])
    print(f"{len(questions)} questions ({', '.join(sorted({q.kind for q in questions}))}; most: {kinds})")
    if args.scale:
        head = ["memories", "embedder", "cutoff", "searches", "memory-service CPU ms / search", "wall p50 ms",
                "wall p90 ms", "wall p99 ms"]
        rows = [row for n in args.scale.split(",") for emb in args.embedders.split(",")
                for row in asyncio.run(_scale(int(n), emb, questions, args.search_rounds))]
        print("\n".join(table(head, rows)))
        return 0
    runs = []
    for emb in args.embedders.split(","):
        for cutoff in (None if c == "own" else float(c) for c in args.cutoffs.split(",")):
            extra = dict(kv.split("=", 1) for kv in args.env)
            runs.append(asyncio.run(_run_stack(emb, cutoff, args.rules.split(","), questions, args.search_rounds,
                                               extra)))
    _print(runs, questions)
    if args.json is not None:
        doc = [{"embedder": r["embedder"], "cutoff": r["cutoff"], "rule": rule,
                "per_question": v["result"].per_question, "first": v["result"].first}
               for r in runs for rule, v in r["rules"].items()]
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
