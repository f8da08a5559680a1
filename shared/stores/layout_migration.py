"""Moving an org's own keys written before they carried the org's hash tag (``ORG:directive:AGENT``
and its siblings) to their tagged names (``{ORG}:directive:AGENT``, ``shared.stores.keys``).

The memory service runs it once when it connects to a single server (a cluster never held the
untagged names): one SCAN per key family, ``RENAMENX`` per key (its value and TTL move with it; a
key already written under the new name wins), then a marker key so later starts skip the scan.
Memory keys kept their names; the per-org search indexes are unchanged on a single server.
"""

from __future__ import annotations

from redis.asyncio import Redis

from .connect import is_cluster
from .keys import is_ident

MARKER_KEY = "ibex:layout"  # no ':'-separated org part that is an identifier followed by a family
MARKER_VALUE = b"org-tags"
_FAMILIES = ("*:directive:*", "*:summary:*", "*:calibration:*", "*:assembly:*", "*:storage", "*:mem_agents")


def tagged_name(key: str) -> str | None:
    """The tagged name of an untagged org key, or None when ``key`` is not one."""
    org, sep, rest = key.partition(":")
    if not sep or not is_ident(org) or org in ("mem", "memids", "hot", "ibex"):
        return None
    return "{" + org + "}:" + rest


async def tag_org_keys(redis: Redis) -> int:
    """Rename every untagged org key of a single server (once); how many were renamed."""
    if is_cluster(redis) or await redis.get(MARKER_KEY) == MARKER_VALUE:
        return 0
    moved = 0
    for pattern in _FAMILIES:
        async for raw in redis.scan_iter(match=pattern, count=1000):
            key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            new = tagged_name(key)
            if new is not None and await redis.renamenx(key, new):
                moved += 1
    await redis.set(MARKER_KEY, MARKER_VALUE)
    return moved
