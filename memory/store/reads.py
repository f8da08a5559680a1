"""The hot-list read of every assembly, in one Redis round trip.

A server-side Lua script reads the ``limit`` most salient ids of the agent's hot list with their
scores, then each memory's record and (when the call ranks for a question) its vector. Every key
it touches is the agent's own (``shared.stores.keys``: one ``{org:agent}`` hash tag, one slot), so it is
atomic, and valid on a Redis Cluster.

Records are read from Redis on every call, never served from process memory: a record changed
straight in Redis is seen by the next read, and a damaged one is skipped and counted on every
read that meets it (docs/security.md "Degradation and security").
"""

from __future__ import annotations

from typing import cast

import numpy as np
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from ...shared.stores.keys import hot_key, memory_key_prefix, vector_field
from ..embedders.embed import Vectors
from .records import MemoryRecord
from .writes import RecordHealth, parse_record

_HOT = """
local pairs = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
local raws, vecs = {}, {}
for i = 1, #pairs, 2 do
  local key = ARGV[2] .. pairs[i]
  if ARGV[3] ~= '' then
    local got = redis.call('HMGET', key, 'rec', ARGV[3])
    raws[#raws + 1] = got[1]
    vecs[#vecs + 1] = got[2]
  else
    raws[#raws + 1] = redis.call('HGET', key, 'rec')
  end
end
return {pairs, raws, vecs}
"""


class Scripts:
    """The service's Lua scripts, registered once per Redis client (sent by SHA, loaded on demand)."""

    def __init__(self, redis: Redis) -> None:
        self.hot: AsyncScript = redis.register_script(_HOT)


HotRead = tuple[list[tuple[MemoryRecord, float]], dict[str, Vectors]]


async def hot_with_vectors(scripts: Scripts, org_id: str, agent_id: str, limit: int, *, embedder_name: str | None,
                           dim: int, health: RecordHealth | None = None) -> HotRead:
    """The ``limit`` most salient hot memories (salience desc, then memory_id) and, with an
    ``embedder_name``, their stored vectors of the right size (others are left out)."""
    if limit <= 0:
        return [], {}
    prefix = memory_key_prefix(org_id, agent_id)
    field = vector_field(embedder_name) if embedder_name is not None else ""
    pairs, raws, vecs = cast(tuple[list[bytes], list[bytes | None], list[bytes | None]], await scripts.hot(
        keys=[hot_key(org_id, agent_id)], args=[limit, prefix, field]))
    found: list[tuple[MemoryRecord, float]] = []
    vectors: dict[str, Vectors] = {}
    for i, raw in enumerate(raws):
        mid = pairs[2 * i].decode()
        rec = parse_record(raw, f"{prefix}{mid}", health, memory_id=mid)
        if rec is None:
            continue
        found.append((rec, float(pairs[2 * i + 1])))
        vec = vecs[i] if i < len(vecs) else None
        if isinstance(vec, bytes) and len(vec) == dim * 4:
            vectors[mid] = np.frombuffer(vec, dtype=np.float32)
    found.sort(key=lambda rs: (-rs[1], rs[0].memory_id))
    return found, vectors
