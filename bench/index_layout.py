"""``python -m bench.index_layout``: what the memory indexes cost per org and per agent, and how the
agents of one org spread over a cluster (docs/memory-search.md "Shards").

1. On one embedded server, the same memories (``--agents`` agents of one org, ``--per-agent``
   memories each, 256-dimension vectors from the hashing embedder) are written twice, after
   ``FLUSHALL``: under one index for the org (the single-server layout), then under one index per
   agent (the cluster layout). Redis's ``used_memory`` after each gives the cost of the extra
   indexes, per index.
2. On an embedded 3 + 3 cluster the same writes, with the per-agent indexes: the primaries'
   ``used_memory`` and key counts show how one org's agents spread.

``--sizing COPIES``: the conversation set's 2,257 turns (real text) with the default embedder's
vectors (minilm, 384 dimensions, computed once), written COPIES times through the seed path
(``--chats-per-agent`` copies of a chat per agent), on one shard of a cluster (index per agent)
and on one server (index per org): bytes per memory of the hash (record, vector), the agents' id
sets and hot lists, each index part (``FT.INFO``) and ``used_memory`` in all.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.memory.embedders.embed import HashingEmbedder
from ibex_context.memory.search.index import ensure_index
from ibex_context.memory.store import writes as store
from ibex_context.memory.store.records import MemoryRecord
from ibex_context.shared.stores.connect import async_client, sync_client

DIM = 256
ORG = "org-layout"
WORDS = [f"w{i}" for i in range(500)]


async def _write(redis: Redis, agents: int, per_agent: int, *, per_agent_index: bool, seed: int) -> None:
    """Every agent's index first (so each write is indexed as it lands), then the memories."""
    rng, emb = random.Random(seed), HashingEmbedder(DIM)

    async def embed(texts: Any) -> Any:
        return emb.embed(list(texts))

    for a in range(agents):
        await ensure_index(redis, "hash", DIM, ORG, f"agent{a}", per_agent=per_agent_index)
    batch: list[store.NewMemory] = []
    for a in range(agents):
        for i in range(per_agent):
            rec = MemoryRecord(memory_id=f"m{i}", content=" ".join(rng.choices(WORDS, k=12)), category="fact",
                               confidence=0.8, created_at=datetime(2026, 1, 1, tzinfo=UTC))
            batch.append(store.NewMemory(ORG, f"agent{a}", rec, hot=False))
        if len(batch) >= 2000:
            await store.write_memories(redis, batch, embedder_name="hash", embed=embed)
            batch = []
    if batch:
        await store.write_memories(redis, batch, embedder_name="hash", embed=embed)


def _used(url: str) -> int:
    with sync_client(url) as r:
        return int(r.info("memory")["used_memory"])


async def single_server(agents: int, per_agent: int) -> dict[str, int]:
    """used_memory (bytes) with no data, with the org's index, with the agents' indexes."""
    out: dict[str, int] = {}
    with EmbeddedRedis(startup_timeout_s=30.0) as server:
        out["empty"] = _used(server.url)
        for layout, per_agent_index in (("index per org", False), ("index per agent", True)):
            with sync_client(server.url) as r:
                r.flushall()
            redis = async_client(server.url)
            try:
                await _write(redis, agents, per_agent, per_agent_index=per_agent_index, seed=7)
            finally:
                await redis.aclose()
            out[layout] = _used(server.url)
    return out


async def on_cluster(agents: int, per_agent: int) -> list[tuple[int, int, int]]:
    """(port, used_memory, keys) of each primary after the per-agent layout's writes."""
    with EmbeddedCluster(primaries=3) as cluster:
        redis = async_client(cluster.url)
        try:
            await _write(redis, agents, per_agent, per_agent_index=True, seed=7)
        finally:
            await redis.aclose()
        rows = []
        for node in cluster.primary_nodes:
            with node.client() as c:
                rows.append((node.port, int(c.info("memory")["used_memory"]), int(c.dbsize())))
        return rows


_INDEX_PARTS = ("inverted_sz_mb", "offset_vectors_sz_mb", "doc_table_size_mb", "sortable_values_size_mb",
                "key_table_size_mb", "tag_overhead_sz_mb", "text_overhead_sz_mb", "vector_index_sz_mb")


def _conversation_records(copies: int, per_agent: int) -> tuple[list[dict[str, Any]], int]:
    """The conversation set's turns, ``copies`` times, ``per_agent`` copies of a chat to one agent."""
    from bench.conversations import load_set

    turns, _ = load_set()
    records = []
    for c in range(copies):
        for t in turns:
            records.append({**t, "agent_id": f"{t['agent_id']}-g{c // per_agent}",
                            "memory_id": f"{t['memory_id']}-k{c}"})
    return records, len(turns)


def _breakdown(url: str, n: int, vfield: str) -> dict[str, float]:
    """Bytes per memory: the memory hashes (record, vector), the agents' id sets and hot lists, each
    index part (``FT.INFO``), and Redis's ``used_memory`` in all."""
    import redis as sync_redis

    out: dict[str, float] = dict.fromkeys(("hashes", "content", "rec", "vector", "sets", *_INDEX_PARTS), 0.0)
    with sync_client(url, decode_responses=True) as r:
        nodes = [r] if not hasattr(r, "get_primaries") else [
            sync_redis.Redis(host=p.host, port=p.port, decode_responses=True) for p in r.get_primaries()]
        for c in nodes:
            for key in c.scan_iter(count=5000):
                used = c.memory_usage(key, samples=0) or 0
                if key.startswith("mem:"):
                    out["hashes"] += used
                    for f, col in (("content", "content"), ("rec", "rec")):
                        out[col] += c.hstrlen(key, f)
                    out["vector"] += c.hstrlen(key, vfield)
                elif key.startswith(("memids:", "hot:")):
                    out["sets"] += used
            for name in c.execute_command("FT._LIST"):
                info = c.execute_command("FT.INFO", name)
                for part in _INDEX_PARTS:
                    out[part] += float(info.get(part, 0)) * 2**20
                out["terms"] = out.get("terms", 0.0) + float(info.get("num_terms", 0))
                out["indexes"] = out.get("indexes", 0.0) + 1
            out["used"] = out.get("used", 0.0) + float(c.info("memory")["used_memory"])
    return {k: (v / n if k not in ("terms", "indexes", "used") else v) for k, v in out.items()}


async def sizing(copies: int, per_agent: int) -> dict[str, dict[str, float]]:
    """The conversation turns with the default embedder's vectors (minilm, computed once), written
    ``copies`` times through the seed path: on one shard of a cluster (index per agent) and on one
    server (index per org). Bytes per memory of each part, and ``used_memory`` over the empty server."""
    import numpy as np

    from bench.conversations import PrecomputedEmbedder
    from ibex_context.memory.embedders.embed import load_embedder
    from ibex_context.memory.service.seed import seed_records
    from ibex_context.shared.stores.keys import vector_field

    records, turns = _conversation_records(copies, per_agent)
    emb = load_embedder("minilm")
    texts = sorted({r["content"] for r in records})
    vectors = np.concatenate([emb.embed(texts[i : i + 64]) for i in range(0, len(texts), 64)]).astype(np.float32)
    pre = PrecomputedEmbedder(emb, texts, vectors)
    out: dict[str, dict[str, float]] = {}
    for layout in ("one shard, index per agent", "one server, index per org"):
        server: Any = EmbeddedCluster(primaries=1, replicas=0) if "shard" in layout else EmbeddedRedis(
            startup_timeout_s=30.0)
        with server:
            empty = _used(server.url) if "server" in layout else _cluster_used(server)
            redis = async_client(server.url)
            try:
                await seed_records(redis, records, embedder=pre)
            finally:
                await redis.aclose()
            await asyncio.sleep(1.0)  # the engine indexes in the background
            row = _breakdown(server.url, len(records), vector_field(pre.name))
            row["over_empty"] = (row["used"] - empty) / len(records)
            row.update(memories=len(records), agents=len({r["agent_id"] for r in records}), turns=turns)
            out[layout] = row
    return out


def _cluster_used(cluster: EmbeddedCluster) -> int:
    total = 0
    for node in cluster.primary_nodes:
        with node.client() as c:
            total += int(c.info("memory")["used_memory"])
    return total


def _print_sizing(rows: dict[str, dict[str, float]]) -> None:
    parts = ["hashes", "content", "rec", "vector", "sets", *_INDEX_PARTS, "over_empty"]
    print("| bytes per memory | " + " | ".join(rows) + " |")
    print("| --- | " + " | ".join("---" for _ in rows) + " |")
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{r[part]:,.0f}" for r in rows.values()) + " |")
    for extra in ("memories", "agents", "indexes", "terms"):
        print(f"| {extra} | " + " | ".join(f"{r.get(extra, 0):,.0f}" for r in rows.values()) + " |")
    for layout, r in rows.items():
        print(f"{layout}: {r['over_empty'] * 1e6 / 2**30:,.2f} GiB per million memories (used_memory over empty)")


def move_under_searches(memories: int, batch: int) -> dict[str, Any]:
    """One agent's ``memories`` on a 3-primary cluster; its slot moved to a fourth, empty primary
    (``ops.reshard.add_shard``-style: ``move_slots`` after ``join``) while one client searches the
    agent without pause (``FT.SEARCH`` routed by slot, following ``ASK`` as the memory service's
    client does). Per search: its time, how many of the agent's memories it saw, errors."""
    import threading
    import time

    from ibex_context.memory.search.index import index_name, total_results
    from ibex_context.ops.reshard import connect, join, move_slots
    from ibex_context.shared.stores.connect import key_slot
    from ibex_context.shared.stores.keys import agent_tag

    org, agent = ORG, "mover"
    with EmbeddedCluster(primaries=3, replicas=0) as cluster:
        asyncio.run(_seed_one(cluster.url, agent, memories))
        spare = cluster.spare_node()
        admin = connect(cluster.url)
        target = join(admin, f"127.0.0.1:{spare.port}")
        name = index_name("hash", org, agent, per_agent=True)
        seen: list[tuple[float, int, float, str]] = []  # (at, hits, ms, error)
        stop, moving = threading.Event(), threading.Event()

        def searcher() -> None:
            with sync_client(cluster.url) as r:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        hits, err = total_results(r.execute_command("FT.SEARCH", name, "@content:w1|w2|w3|w4|w5",
                                                                    "LIMIT", "0", "0")), ""
                    except Exception as exc:  # what a caller would see
                        hits, err = -1, f"{type(exc).__name__}: {str(exc)[:60]}"
                    seen.append((t0, hits, (time.perf_counter() - t0) * 1000.0, err if moving.is_set() else ""))

        with sync_client(cluster.url) as r:
            full = total_results(r.execute_command("FT.SEARCH", name, "@content:w1|w2|w3|w4|w5", "LIMIT", "0", "0"))
        thread = threading.Thread(target=searcher)
        thread.start()
        time.sleep(0.5)
        t_start = time.perf_counter()
        moving.set()
        report = move_slots(admin, [key_slot(agent_tag(org, agent))], target, batch=batch, progress=lambda _: None)
        t_end = time.perf_counter()
        time.sleep(0.5)
        stop.set()
        thread.join()
        admin.close()
    during = [s for s in seen if t_start <= s[0] <= t_end]
    before = [s for s in seen if s[0] < t_start]
    return {"memories": memories, "matching": full, "batch": batch, "keys": report.keys,
            "move_s": t_end - t_start, "during": during, "before": before,
            "after": [s for s in seen if s[0] > t_end]}


async def _seed_one(url: str, agent: str, memories: int) -> None:
    redis = async_client(url)
    try:
        rng, emb = random.Random(7), HashingEmbedder(DIM)

        async def embed(texts: Any) -> Any:
            return emb.embed(list(texts))

        await ensure_index(redis, "hash", DIM, ORG, agent)
        items = [store.NewMemory(ORG, agent, MemoryRecord(memory_id=f"m{i}", content=" ".join(rng.choices(WORDS, k=12)),
                                                          category="fact", confidence=0.8,
                                                          created_at=datetime(2026, 1, 1, tzinfo=UTC)), hot=False)
                 for i in range(memories)]
        for i in range(0, len(items), 2000):
            await store.write_memories(redis, items[i : i + 2000], embedder_name="hash", embed=embed)
    finally:
        await redis.aclose()


def _print_move(res: dict[str, Any]) -> None:
    from statistics import median

    def row(label: str, xs: list[tuple[float, int, float, str]]) -> str:
        ok = [x for x in xs if x[1] >= 0]
        ms = sorted(x[2] for x in xs) or [0.0]
        hits = [x[1] / max(res["matching"], 1) for x in ok] or [0.0]
        return (f"| {label} | {len(xs)} | {len(xs) - len(ok)} | {min(hits):.2f} / {median(hits):.2f} / {max(hits):.2f} "
                f"| {median(ms):.2f} / {ms[int(0.99 * (len(ms) - 1))]:.2f} |")

    print(f"one agent, {res['memories']} memories ({res['matching']} match the query), its slot moved to a new "
          f"primary: {res['keys']} keys in {res['move_s']:.2f}s, {res['batch']} keys per MIGRATE")
    print("| searches | n | errors | share of the agent's matches seen, min / median / max | ms p50 / p99 |")
    print("| --- | --- | --- | --- | --- |")
    for label in ("before", "during", "after"):
        print(row(label, res[label]))
    errors = Counter(x[3] for x in res["during"] if x[3])
    for err, n in errors.most_common():
        print(f"  during: {n} x {err}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.index_layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--per-agent", type=int, default=20)
    ap.add_argument("--sizing", type=int, default=0, metavar="COPIES",
                    help="instead: the conversation set's turns COPIES times with minilm vectors, bytes per memory "
                         "on one shard (index per agent) and one server (index per org)")
    ap.add_argument("--chats-per-agent", type=int, default=2,
                    help="--sizing: copies of one chat written to one agent (a chat is ~450 turns)")
    ap.add_argument("--move", type=int, default=0, metavar="MEMORIES",
                    help="instead: one agent of MEMORIES memories, its slot moved to a new primary under searches")
    ap.add_argument("--batch", type=int, default=100, help="--move: keys per MIGRATE")
    args = ap.parse_args(argv)
    if args.move:
        _print_move(move_under_searches(args.move, args.batch))
        return 0
    if args.sizing:
        _print_sizing(asyncio.run(sizing(args.sizing, args.chats_per_agent)))
        return 0
    single = asyncio.run(single_server(args.agents, args.per_agent))
    n = args.agents * args.per_agent
    print(f"one server, {args.agents} agents x {args.per_agent} memories ({n} memories, {DIM} dims):")
    for layout in ("index per org", "index per agent"):
        used = single[layout] - single["empty"]
        print(f"  {layout:16s} {used / 1e6:8.1f} MB  ({used / n:,.0f} B per memory)")
    extra = single["index per agent"] - single["index per org"]
    print(f"  per-agent indexes cost {extra / 1e6:.1f} MB more: {extra / max(args.agents - 1, 1):,.0f} B per index")
    print("cluster of 3 primaries (+3 replicas), index per agent:")
    for port, used, keys in asyncio.run(on_cluster(args.agents, args.per_agent)):
        print(f"  primary :{port}  {used / 1e6:8.1f} MB used  {keys} keys")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
