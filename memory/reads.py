"""The two reads every assembly makes, each in one Redis round trip (issue 18: the memory service
must not cost as much CPU as the worker it serves).

Each Redis command costs this service a socket write and a reply to parse, and on loopback the
write is most of the CPU: the hot list used three (ZREVRANGE, HMGET records, HMGET vectors) and a
search two (the index tag, then the records). Here each is one server-side Lua script, atomic, so
what it returns is one consistent view:

* ``hot_with_vectors``: the ``limit`` most salient ids with their scores, their records and (when
  the call ranks for a question) their vectors.
* ``records_if_current``: the records of the candidates a search picked from its cached index,
  read with the agent's index tag (revision, record count); when the tag is no longer the cached
  index's (a write happened), nothing is parsed and the caller rebuilds the index and hydrates again.

Records are read from Redis on every call, never served from process memory: a record changed
straight in Redis (no revision bump) is seen by the next read, and a damaged one is skipped and
counted on every read that meets it (README, "Degradation and security").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ibex_context.memory.embed import Vectors
from ibex_context.memory.models import MemoryRecord
from ibex_context.memory.store import IndexTag, RecordHealth, parse_record, parse_records
from ibex_context.shared.keys import hot_key, memories_key, rev_key, vectors_key

_HOT = """
local pairs = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
local ids = {}
for i = 1, #pairs, 2 do ids[#ids + 1] = pairs[i] end
if #ids == 0 then return {pairs, {}, {}} end
local vecs = {}
if ARGV[2] == '1' then vecs = redis.call('HMGET', KEYS[3], unpack(ids)) end
return {pairs, redis.call('HMGET', KEYS[2], unpack(ids)), vecs}
"""

_TAG_AND_RECORDS = """
local raws = {}
if #ARGV > 0 then raws = redis.call('HMGET', KEYS[2], unpack(ARGV)) end
return {redis.call('GET', KEYS[1]) or false, redis.call('HLEN', KEYS[2]), raws}
"""

# Lua's unpack() has a stack limit (LUAI_MAXCSTACK 8000): hydrate larger sets in the old way.
MAX_SCRIPT_IDS = 4_000


class Scripts:
    """The service's Lua scripts, registered once per Redis client (sent by SHA, loaded on demand)."""

    def __init__(self, redis: Redis) -> None:
        self.hot: AsyncScript = redis.register_script(_HOT)
        self.tag_and_records: AsyncScript = redis.register_script(_TAG_AND_RECORDS)


HotRead = tuple[list[tuple[MemoryRecord, float]], dict[str, Vectors]]


async def hot_with_vectors(scripts: Scripts, org_id: str, agent_id: str, limit: int, *, embedder_name: str | None,
                           dim: int, health: RecordHealth | None = None) -> HotRead:
    """The ``limit`` most salient hot memories (salience desc, then memory_id) and, with an
    ``embedder_name``, their stored vectors of the right size (others are left out)."""
    if limit <= 0:
        return [], {}
    mkey = memories_key(org_id, agent_id)
    vkey = vectors_key(org_id, agent_id, embedder_name) if embedder_name is not None else mkey
    pairs, raws, vecs = cast(tuple[list[bytes], list[bytes | None], list[bytes | None]], await scripts.hot(
        keys=[hot_key(org_id, agent_id), mkey, vkey], args=[limit, "1" if embedder_name is not None else "0"]))
    found: list[tuple[MemoryRecord, float]] = []
    vectors: dict[str, Vectors] = {}
    for i, raw in enumerate(raws):
        mid = pairs[2 * i].decode()
        rec = parse_record(raw, f"{mkey}/{mid}", health, memory_id=mid)
        if rec is None:
            continue
        found.append((rec, float(pairs[2 * i + 1])))
        vec = vecs[i] if i < len(vecs) else None
        if isinstance(vec, bytes) and len(vec) == dim * 4:
            vectors[mid] = np.frombuffer(vec, dtype=np.float32)
    found.sort(key=lambda rs: (-rs[1], rs[0].memory_id))
    return found, vectors


async def records_if_current(scripts: Scripts, org_id: str, agent_id: str, ids: Sequence[str], tag: IndexTag,
                             health: RecordHealth | None = None) -> dict[str, MemoryRecord] | None:
    """The valid records of ``ids`` if the agent's index tag is still ``tag`` (read atomically with
    them), else ``None``: a write happened since the index was built, and the caller rebuilds it."""
    mkey = memories_key(org_id, agent_id)
    rev, count, raws = cast(tuple[bytes | None, int, list[bytes | None]], await scripts.tag_and_records(
        keys=[rev_key(org_id, agent_id), mkey], args=list(ids)))
    if (rev, int(count)) != tag:
        return None
    return parse_records(ids, raws, mkey, health)
