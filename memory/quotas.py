"""Write quotas: one org cannot fill the shared store or take the service's CPU with writes
(docs/security.md "Degradation and security").

Checked before a write is embedded, so a refused write costs nothing:

* **Agents per org** (``IBEX_MEMORY_MAX_AGENTS_PER_ORG``): a write for an agent the org does not
  have yet is refused once the org has that many (409).
* **Bytes per org** (``IBEX_MEMORY_MAX_BYTES_PER_ORG``): the org's stored memory text, counted in
  UTF-8 bytes; a write that would take it over is refused (409). A rewrite counts only what it adds.
* **The store's own memory**: when Redis has a ``maxmemory`` and uses more than
  ``IBEX_MEMORY_WRITE_FLOOR_FRACTION`` of it (0.90), every memory write is refused (507) while
  reads go on, leaving the rest to directives, calibration and the index's own growth. The embedded
  server runs with a ``maxmemory`` and ``noeviction`` (docs/deploy.md "Backing services").
* **Embedding CPU**: an org's writes are embedded one at a time (``IBEX_MEMORY_MAX_WRITES_PER_ORG``),
  and at most ``IBEX_MEMORY_MAX_WRITE_EMBEDS`` writes of all orgs at once, so a tenant sending large
  writes queues behind itself and searches never queue behind writes.

The counters live in Redis under the org's own tag (``{org}:mem_agents``, ``{org}:mem_bytes``) and
are updated after each write, so processes writing for one org at the same moment can pass a
limit by the writes in flight (at most one per process per org), never by more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from ibex_context.shared.stores.keys import memory_key, org_memory_agents_key, org_memory_bytes_key

STORE_INFO_TTL_S = 1.0  # INFO memory is read at most this often per process


class QuotaExceeded(Exception):
    """A write the org's quota does not allow; ``field`` names what to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class StoreFull(Exception):
    """The store is near its ``maxmemory``: writes wait until memory is freed or added."""


@dataclass(frozen=True, slots=True)
class Quotas:
    max_agents: int
    max_bytes: int
    floor_fraction: float


@dataclass(slots=True)
class StorePressure:
    """The store's memory use, read at most once per ``STORE_INFO_TTL_S``."""

    used: int = 0
    limit: int = 0
    read_at: float = -1e9

    async def check(self, redis: Redis, fraction: float, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.read_at >= STORE_INFO_TTL_S:
            info = await redis.info("memory")
            self.used, self.limit, self.read_at = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), now
        if self.limit > 0 and self.used >= fraction * self.limit:
            raise StoreFull(f"the memory store is nearly full ({self.used:,} of {self.limit:,} bytes used); "
                            "memory writes are refused until memory is freed or added")


async def check_write(redis: Redis, quotas: Quotas, org: str, agent: str, memory_id: str, content: str
                      ) -> int:
    """Refuse (``QuotaExceeded``) a write the org's quotas do not allow; else the bytes it adds."""
    agents_key, bytes_key = org_memory_agents_key(org), org_memory_bytes_key(org)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sismember(agents_key, agent)
        pipe.scard(agents_key)
        pipe.get(bytes_key)
        pipe.hstrlen(memory_key(org, agent, memory_id), "content")
        known, n_agents, stored, old_chars = await pipe.execute()
    if not known and int(n_agents) >= quotas.max_agents:
        raise QuotaExceeded(f"agent_id: the org already has {int(n_agents):,} agents with memories, the cap is "
                            f"{quotas.max_agents:,} (IBEX_MEMORY_MAX_AGENTS_PER_ORG)", "agent_id")
    # HSTRLEN is the stored field's length in bytes: the same unit as the counter.
    added = len(content.encode()) - int(old_chars or 0)
    total = int(stored or 0) + max(added, 0)
    if added > 0 and total > quotas.max_bytes:
        raise QuotaExceeded(f"content: the org's memories would hold {total:,} bytes of text, the cap is "
                            f"{quotas.max_bytes:,} (IBEX_MEMORY_MAX_BYTES_PER_ORG)", "content")
    return added


async def account_write(redis: Redis, org: str, agent: str, added: int) -> None:
    """Count a stored write in the org's counters."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sadd(org_memory_agents_key(org), agent)
        if added:
            pipe.incrby(org_memory_bytes_key(org), added)
        await pipe.execute()
