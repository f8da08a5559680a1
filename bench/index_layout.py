"""``python -m bench.index_layout``: what the memory indexes cost per org and per agent, and how the
agents of one org spread over a cluster (docs/memory-search.md "Shards").

1. On one embedded server, the same memories (``--agents`` agents of one org, ``--per-agent``
   memories each, 256-dimension vectors from the hashing embedder) are written twice, after
   ``FLUSHALL``: under one index for the org (the single-server layout), then under one index per
   agent (the cluster layout). Redis's ``used_memory`` after each gives the cost of the extra
   indexes, per index.
2. On an embedded 3 + 3 cluster the same writes, with the per-agent indexes: the primaries'
   ``used_memory`` and key counts show how one org's agents spread.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.memory.embedders.embed import HashingEmbedder
from ibex_context.memory.search.index import ensure_index
from ibex_context.memory.service.models import MemoryRecord
from ibex_context.memory.store import writes as store
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.index_layout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--per-agent", type=int, default=20)
    args = ap.parse_args(argv)
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
