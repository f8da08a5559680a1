"""``ibex-context demo`` (``make run``): start the stack if needed, seed what of the demo data is
missing, print demo assemblies.

The demo never overwrites what is already there: a directive is seeded only for an agent that has
none, a memory only when its id is not stored (demo memories have ids derived from org, agent and
content, ``memory.service.seed.derived_memory_id``). A directive or memory someone set, edited or seeded
before, demo or not, is kept exactly as it is, so ``make run`` after ``make up`` and some real
use changes nothing of it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..shared.config.settings import Settings
from ..shared.stores.keys import directive_key, memory_key
from . import stack
from .launch import up

DEMO_REQUESTS = [
    ("acme", "support-bot", "gpt-4o", "The customer asks where their invoice from October is."),
    ("acme", "support-bot", "claude-sonnet-4", "What do we know about the customer's contact preferences?"),
    ("globex", "research-agent", "gpt-4.1-mini", "Summarise what we know about the literature review."),
]


def _record_key(raw: Mapping[str, Any]) -> str:
    """The Redis key a (validated) seed record would write: its directive, or its memory's hash."""
    from ..memory.service.seed import derived_memory_id

    org, agent = raw["org_id"], raw["agent_id"]
    if raw.get("kind") == "directive":
        return directive_key(org, agent)
    return memory_key(org, agent, raw.get("memory_id") or derived_memory_id(org, agent, raw["content"]))


async def seed_missing(url: str, path: Path = stack.DEMO_DATA) -> tuple[int, int, int]:
    """Seed the records of ``path`` whose directive or memory is not stored yet.

    Returns (memories added, directives added, records kept as they were). Every record is validated
    before anything is written (``memory.service.seed``); a kept one is never read or rewritten.
    """
    from ..memory.service.seed import parse_records, read_jsonl, seed_records
    from ..shared.stores.connect import async_client

    records = read_jsonl(path)
    parse_records(records, now=datetime.now(UTC))  # a bad line fails here, before any lookup
    client = async_client(url, socket_timeout=10, socket_connect_timeout=5)
    try:
        keys = [_record_key(raw) for _, raw in records]
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            present = await pipe.execute()
        missing = [rec for rec, there in zip(records, present, strict=True) if not there]
        if not missing:
            return 0, 0, len(records)
        stats = await seed_records(client, missing)
    finally:
        await client.aclose()
    return stats.memories, stats.directives, len(records) - len(missing)


def _seed(url: str) -> bool:

    from ..memory.service.seed import SeedError
    from ..shared.stores.connect import REDIS_ERRORS

    print(f"ibex-context: seeding what is missing of the demo data ({stack.DEMO_DATA}) ...")
    failures: tuple[type[Exception], ...] = (SeedError, OSError, *REDIS_ERRORS)
    try:
        memories, directives, kept = asyncio.run(seed_missing(url))
    except failures as exc:
        print(f"ibex-context demo: seeding failed: {exc}", file=sys.stderr)
        return False
    print(f"ibex-context: added {memories} memories and {directives} directives; "
          f"{kept} already there, kept as they are")
    return True


def demo(*, keep: bool, show: Callable[[Any], None]) -> int:
    from ..client.client import AsyncClient
    from ..shared.wire.errors import IbexError

    if up() != 0:
        return 1
    state = stack.read_host_file(stack.run_dir_of(stack.CONF))
    url = state["redis_url"] if state else stack._supervisor_env(Settings())["IBEX_REDIS_URL"]
    if not _seed(url):
        return 1

    async def run() -> int:
        failures = 0
        async with AsyncClient() as c:
            await c.wait_connected()
            for org, agent, model, query in DEMO_REQUESTS:
                print(f"\n=== {org}/{agent} on {model}: {query}")
                try:
                    resp = await c.assemble(org_id=org, agent_id=agent, model=model, query=query, timeout=0.25,
                                            recent_messages=[{"role": "user", "content": query}])
                except IbexError as exc:
                    failures += 1
                    print(f"  {exc.code.value}: {exc.message}")
                    continue
                show(resp)
        return failures

    failures = asyncio.run(run())
    if keep:
        print("\nThe stack is still running: `make down` (or `.venv/bin/ibex-context down`) stops it.")
    else:
        stack.down()
    return 1 if failures == len(DEMO_REQUESTS) else 0
