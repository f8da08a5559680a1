"""Write quotas: one org cannot fill the shared store or take the service's CPU with writes
(docs/security.md "Degradation and security", "Storage budgets").

Checked before a write is embedded, so a refused write costs nothing:

* **Agents per org** (``IBEX_MEMORY_MAX_AGENTS_PER_ORG``): a write for an agent the org does not
  have yet is refused once the org has that many (409).
* **Storage per org** (``IBEX_ORG_STORAGE_BYTES``, ``IBEX_ORG_STORAGE_FRACTION``): each memory is
  charged what Redis holds for it, index included (``memory.store.writes.memory_charge``), to the org's
  ledger shared with its summaries and calibration (``shared.stores.storage``). The charge is
  reserved before the write, so writes in flight can never pass the budget; a rewrite is credited
  what the memory it replaced was charged, a failed write its whole reservation (409 when over).
* **The store's own memory**: when Redis has a ``maxmemory`` and uses more than
  ``IBEX_MEMORY_WRITE_FLOOR_FRACTION`` of it (0.90), every memory write is refused (507) while
  reads go on, leaving the rest to directives, summaries, calibration and the index's own growth.
  The embedded server runs with a ``maxmemory`` and ``noeviction`` (docs/deploy.md "Backing services").
* **Embedding CPU**: an org's writes are embedded one at a time (``IBEX_MEMORY_MAX_WRITES_PER_ORG``),
  and at most ``IBEX_MEMORY_MAX_WRITE_EMBEDS`` writes of all orgs at once, so a tenant sending large
  writes queues behind itself and searches never queue behind writes.

The agents of an org live in Redis under its own key (``{org}:mem_agents``) and are added after
each write, so processes writing for one org at the same moment can pass the agents cap by the
writes in flight (at most one per process per org), never by more.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from ...shared.stores.keys import org_memory_agents_key
from ...shared.stores.storage import StorePressure


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
    floor_fraction: float


def check_floor(pressure: StorePressure, fraction: float) -> None:
    """``StoreFull`` when Redis uses ``fraction`` of its ``maxmemory`` or more."""
    if pressure.over(fraction):
        raise StoreFull(f"the memory store is nearly full ({pressure.used:,} of {pressure.limit:,} bytes used); "
                        "memory writes are refused until memory is freed or added")


async def check_agents(redis: Redis, quotas: Quotas, org: str, agent: str) -> None:
    """Refuse (``QuotaExceeded``) a write for a new agent of an org that has ``max_agents``."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sismember(org_memory_agents_key(org), agent)
        pipe.scard(org_memory_agents_key(org))
        known, n_agents = await pipe.execute()
    if not known and int(n_agents) >= quotas.max_agents:
        raise QuotaExceeded(f"agent_id: the org already has {int(n_agents):,} agents with memories, the cap is "
                            f"{quotas.max_agents:,} (IBEX_MEMORY_MAX_AGENTS_PER_ORG)", "agent_id")


async def account_write(redis: Redis, org: str, agent: str) -> None:
    """Count a stored write's agent in the org's agents."""
    await redis.sadd(org_memory_agents_key(org), agent)
