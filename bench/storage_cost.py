"""What Redis really holds for each kind of write, against what the storage budget charges for it.

    python -m bench.storage_cost [--memories 200] [--large 20]

Starts its own bundled Redis (with the query engine) and, for each kind of memory text, a fresh org:
creates the org's index, writes one memory (the index's first allocations, reported apart), then
``--memories`` more through the memory service's own write path (``memory.store.writes.write_capped``,
the hash embedder's 256-dimension vectors) and reports per memory:

* ``measured``: the growth of ``INFO memory`` ``used_memory``, divided by the memories written;
* ``hash``: ``MEMORY USAGE`` of the memory's key (the record, its fields and the vector);
* ``index``: the growth of the org's index as ``FT.INFO`` reports it (inverted lists, offsets,
  doc table, tags, vectors), per memory;
* ``charged``: what ``shared.stores.storage`` charges (``memory.store.writes.memory_charge``), and
  ``charged / measured``, which must stay at or above 1.

Then summaries (``worker.summaries``' stored value) and calibration sketches and assembly records
(``worker.calibration_store``): measured by ``used_memory`` growth over many keys, against their
charge. Kinds of text: ``tiny`` (one character), ``normal`` (a sentence of common words),
``distinct`` (words never seen before, with suffixes English stemming strips: two terms each),
``large`` (64,000 characters of common words) and ``large-distinct`` (64,000 characters of new
words: the dearest memory a caller can write).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.memory.embedders.embed import HashingEmbedder
from ibex_context.memory.search.index import ensure_index, index_name
from ibex_context.memory.store import writes as store
from ibex_context.memory.store.records import MAX_CONTENT_CHARS, MemoryRecord
from ibex_context.pipeline.counting.calibration import N_BUCKETS
from ibex_context.shared.stores import storage
from ibex_context.shared.stores.keys import assembly_key, calibration_key, summary_key
from ibex_context.worker import calibration_store as calibration

DIM = 256
COMMON = ("the invoice for the account is sent on the first day of each month and the customer pays by card "
          "within thirty days unless the contract says otherwise").split()
_SIZE_FIELDS = ("inverted_sz_mb", "offset_vectors_sz_mb", "doc_table_size_mb", "sortable_values_size_mb",
                "key_table_size_mb", "tag_overhead_sz_mb", "text_overhead_sz_mb", "vector_index_sz_mb",
                "geoshapes_sz_mb")


def _new_word(rng: random.Random) -> str:
    stem = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
    return stem + rng.choice(("ing", "ed", "s", "ly", "ness"))


def texts(kind: str, rng: random.Random) -> Callable[[], str]:
    if kind == "tiny":
        return lambda: rng.choice(string.ascii_lowercase)
    if kind == "normal":
        return lambda: " ".join(rng.choice(COMMON) for _ in range(18))
    if kind == "distinct":
        return lambda: " ".join(_new_word(rng) for _ in range(18))
    if kind == "large":
        return lambda: _fill(lambda: rng.choice(COMMON))
    if kind == "large-distinct":
        return lambda: _fill(lambda: _new_word(rng))
    raise ValueError(kind)


def _fill(word: Callable[[], str]) -> str:
    parts, n = [], 0
    while True:
        w = word()
        if n + len(w) + 1 > MAX_CONTENT_CHARS:
            return " ".join(parts)
        parts.append(w)
        n += len(w) + 1


async def used(redis: Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def index_bytes(redis: Redis, org: str) -> float:
    raw = await redis.execute_command("FT.INFO", index_name("hash", org, "bot"))
    info = raw if isinstance(raw, dict) else {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}
    info = {(k.decode() if isinstance(k, bytes) else k): v for k, v in info.items()}
    return sum(float(info.get(f, 0) or 0) for f in _SIZE_FIELDS) * 1024 * 1024


async def memory_kind(redis: Redis, kind: str, n: int, rng: random.Random) -> dict[str, Any]:
    org, agent, embedder = f"org-{kind}", "bot", HashingEmbedder(DIM)
    make = texts(kind, rng)

    async def embed(batch: Any) -> Any:
        return embedder.embed(list(batch))

    def record(i: int) -> MemoryRecord:
        return MemoryRecord(memory_id=f"m-{i:06d}", content=make(), category="fact", confidence=0.8,
                            created_at=datetime(2026, 1, 1, tzinfo=UTC))

    async def write(rec: MemoryRecord) -> int:
        await store.write_capped(redis, store.NewMemory(org, agent, rec, True), embedder_name="hash", embed=embed,
                                 max_per_agent=1 << 30)
        return store.memory_charge(org, agent, rec, hot=True, embedder_name="hash", dim=DIM)

    b0, i0 = await used(redis), 0.0
    await ensure_index(redis, "hash", DIM, org, agent)
    b1 = await used(redis)
    await write(record(0))
    b2, i1 = await used(redis), await index_bytes(redis, org)
    charged, keys = 0, []
    for i in range(1, n + 1):
        rec = record(i)
        charged += await write(rec)
        keys.append(f"mem:{{{org}:{agent}}}:{rec.memory_id}")
    await asyncio.sleep(0.2)  # the engine indexes in the write; nothing is deferred, but let it settle
    b3, i2 = await used(redis), await index_bytes(redis, org)
    hash_sizes = [int(await redis.memory_usage(k) or 0) for k in keys]
    measured = (b3 - b2) / n
    chars = [len(await redis.hget(k, "content") or b"") for k in keys]
    return {"kind": kind, "chars": sum(chars) / n,
            "measured": measured, "hash": sum(hash_sizes) / n, "index": (i2 - i1) / n, "charged": charged / n,
            "ratio": charged / n / measured, "first": (b1 - b0) + (b2 - b1), "index0": i0}


async def strings_kind(redis: Redis, kind: str, n: int, rng: random.Random) -> dict[str, Any]:
    """Summaries, assembly records or calibration sketches: ``n`` keys, their growth against their charge."""
    before, charged = await used(redis), 0
    for i in range(n):
        if kind == "summary":
            key = summary_key("org-s", "bot", f"conv-{i:06d}")
            value = b'{"text":"' + " ".join(_new_word(rng) for _ in range(60)).encode() + b'","covers":12}'
            await redis.set(key, value, ex=86_400)
            charged += storage.string_cost(len(key), len(value))
        elif kind == "assembly record":
            key = assembly_key("org-a", f"{rng.getrandbits(128):032x}")
            value = f"{rng.randint(1, 200_000)}:claude-sonnet-4-5".encode()
            await redis.set(key, value, ex=calibration.RECORD_TTL_S)
            charged += calibration.record_charge(key)
        else:
            model = f"model-{i:06d}"
            await calibration.apply_batch(redis, "org-c", model, {b: 1 for b in range(N_BUCKETS)},
                                          calibration.SketchPolicy(decay=0.999), budget=1 << 40)
            charged += calibration.sketch_charge(calibration_key("org-c", model))
    measured = (await used(redis) - before) / n
    return {"kind": kind, "measured": measured, "charged": charged / n, "ratio": charged / n / measured}


async def run(memories: int, large: int) -> None:
    rng = random.Random(7)
    with EmbeddedRedis(maxmemory=8 << 30) as server:
        redis = Redis.from_url(server.url, protocol=3)
        try:
            print(f"{'memory text':<15} {'chars':>7} {'measured':>9} {'hash':>8} {'index':>8} {'charged':>9} "
                  f"{'charged/measured':>16}")
            for kind in ("tiny", "normal", "distinct", "large", "large-distinct"):
                row = await memory_kind(redis, kind, large if kind.startswith("large") else memories, rng)
                print(f"{row['kind']:<15} {row['chars']:>7.0f} {row['measured']:>9.0f} {row['hash']:>8.0f} "
                      f"{row['index']:>8.0f} {row['charged']:>9.0f} {row['ratio']:>16.2f}")
                if kind == "tiny":
                    first = row["first"]
            print(f"(an org's index and its first memory: {first:,.0f} bytes; the index is charged with the first: "
                  f"{storage.INDEX_BYTES:,})")
            print()
            print(f"{'other keys':<15} {'measured':>9} {'charged':>9} {'charged/measured':>16}")
            for kind in ("summary", "assembly record", "sketch"):
                row = await strings_kind(redis, kind, 2000 if kind != "sketch" else 300, rng)
                print(f"{row['kind']:<15} {row['measured']:>9.0f} {row['charged']:>9.0f} {row['ratio']:>16.2f}")
        finally:
            await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.storage_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--memories", type=int, default=200, help="memories per small kind (default 200)")
    ap.add_argument("--large", type=int, default=20, help="memories per large kind (default 20)")
    args = ap.parse_args(argv)
    asyncio.run(run(args.memories, args.large))


if __name__ == "__main__":
    main()
