"""The search's engine replies read the same in RESP2 and RESP3 (``memory.search.index``).

The memory service sends a search's ``FT.SEARCH`` commands on a RESP2 client
(``MemoryService.search_redis``) and its other commands on RESP3; each reader takes either form.
Every query a search sends (a word's scan, a word's count in a sample, the nearest vectors with
their records and token states, the full-text-only candidates' reads) is sent to a real server on
both protocols here, and what each reader makes of the two replies must be equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from redis.asyncio import Redis

from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.search.index import (
    fields_of,
    index_name,
    knn_query,
    nearest,
    scored_ids,
    search_args,
    tenant_query,
    total_results,
    word_query,
)
from ibex_context.memory.service.seed import seed_records
from ibex_context.shared.stores.keys import memory_key, memory_key_prefix, states_field, vector_field

ORG, AGENT = "acme", "bot"
WORDS = ["invoice", "refund", "zebra", "lisbon"]


def _memories() -> list[dict[str, Any]]:
    out = [{"org_id": ORG, "agent_id": AGENT, "memory_id": f"m{i}", "category": "fact", "confidence": 0.8,
            "content": f"{WORDS[i % 4]} note {i}: the {WORDS[(i * 3) % 4]} of account {i % 7}"} for i in range(40)]
    out.append({"org_id": ORG, "agent_id": "other", "memory_id": "x0", "category": "fact", "content": "invoice zebra"})
    return out


async def _both(url: str, command: tuple[Any, ...]) -> tuple[Any, Any]:
    """``command``'s reply from a RESP2 and from a RESP3 connection."""
    replies = []
    for protocol in (2, 3):
        client = Redis.from_url(url, protocol=protocol)
        try:
            replies.append(await client.execute_command(*command))
        finally:
            await client.aclose()
    return replies[0], replies[1]


async def test_each_reader_reads_resp2_as_it_reads_resp3(redis_url: str) -> None:
    emb = load_embedder("hash")
    seeder = Redis.from_url(redis_url)
    try:
        await seed_records(seeder, _memories(), embedder=emb)
        sfield = states_field(emb.name)
        for i in range(0, 40, 3):  # some memories with token states (bytes the readers pass on as they are)
            await seeder.hset(memory_key(ORG, AGENT, f"m{i}"), sfield, bytes([1, 64]) + bytes(range(i, i + 66)))
    finally:
        await seeder.aclose()
    name, prefix, vfield = index_name(emb.name, ORG, AGENT), memory_key_prefix(ORG, AGENT), vector_field(emb.name)

    for word in [*WORDS, "absent"]:
        scan = ("FT.SEARCH", name, *search_args(word_query(ORG, AGENT, word), limit=50, returns=(), scored=True))
        two, three = await _both(redis_url, scan)
        assert scored_ids(two, prefix) == scored_ids(three, prefix)
        assert total_results(two) == total_results(three)
        assert word == "absent" or scored_ids(two, prefix)
        sample = [f"{prefix}m{i}" for i in range(0, 40, 2)]
        count = ("FT.SEARCH", name, *search_args(word_query(ORG, AGENT, word), limit=0, returns=(), scored=False,
                                                 in_keys=sample))
        two, three = await _both(redis_url, count)
        assert total_results(two) == total_results(three)

    query = emb.embed_query("the invoice of the zebra account")
    for k in (1, 7, 40):
        knn = ("FT.SEARCH", name, *search_args(knn_query(ORG, AGENT, vfield, k, exact=True), limit=k,
                                               returns=("vd", "rec", sfield), scored=False,
                                               params={"vec": np.asarray(query, dtype=np.float32).tobytes()},
                                               sort_by="vd"))
        two, three = await _both(redis_url, knn)
        got = nearest(two, prefix, sfield)
        assert got == nearest(three, prefix, sfield)
        cosine, recs, states = got
        assert len(cosine) == min(k, 40) and all(isinstance(r, bytes) for r in recs.values())
        assert {m for m, s in states.items() if s is not None} <= {f"m{i}" for i in range(0, 40, 3)}
        assert nearest(two, prefix) == (cosine, recs, {})

    keys = [f"{prefix}m{i}" for i in range(5, 25)] + [f"{prefix}gone"]
    fields = ("rec", vfield, sfield)
    read = ("FT.SEARCH", name, *search_args(tenant_query(ORG, AGENT), limit=len(keys), returns=fields, scored=False,
                                            in_keys=keys))
    two, three = await _both(redis_url, read)
    rows = fields_of(two, prefix, fields)
    assert rows == fields_of(three, prefix, fields)
    assert sorted(rows) == sorted(f"m{i}" for i in range(5, 25))
    assert all(row[2] is None for m, row in rows.items() if int(m[1:]) % 3)
