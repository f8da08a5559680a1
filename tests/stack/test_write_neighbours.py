"""Large memory writes of one org leave another org's assemblies whole (``memory.store.quotas``): an org's
writes are embedded one at a time (``IBEX_MEMORY_MAX_WRITES_PER_ORG``) and at most
``IBEX_MEMORY_MAX_WRITE_EMBEDS`` of all orgs at once, so four writers of the largest memories queue
behind each other and the searches of globex's assemblies do not queue behind them. Real broker,
two workers, memory service and Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.selection.hits import MAX_CONTENT_CHARS
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from tests.helpers import eventually, start_stack
from tests.stack.test_tenant_isolation import cjk

pytestmark = pytest.mark.timeout(300)

# Branch timeouts well above a normal search (~2 ms) so a loaded 2-core box does not degrade
# globex by itself; the write caps are the defaults (one write of an org embedded at once, two in all).
ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "500", "IBEX_HOT_TIMEOUT_MS": "500",
       "IBEX_COLD_TIMEOUT_MS": "500", "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_RETRIEVAL_TIMEOUT_MS": "1500",
       "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30"}
WRITERS = 4
ASSEMBLIES = 60
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("write-neighbours"), workers=2, env=ENV)
    try:
        yield s
    finally:
        s.stop()


async def writer(stack: LocalStack, n: int, stop: asyncio.Event, codes: list[int]) -> None:
    """acme's writer ``n``: the largest memory the service takes, a fresh text each time (no warm
    feature cache), rewritten under one id so the store does not grow."""
    headers = {"authorization": f"Bearer {mint_org_token(stack.secret, 'acme')}"}
    async with httpx.AsyncClient(base_url=stack.memory_url, headers=headers, timeout=60.0) as http:
        i = 0
        while not stop.is_set():
            r = await http.post("/v1/memories", json={"agent_id": "support-bot", "memory_id": f"bulk-{n}",
                                                      "content": cjk(MAX_CONTENT_CHARS, seed=n * 10_000 + i),
                                                      "category": "fact"})
            codes.append(r.status_code)
            i += 1


async def test_four_large_writers_of_one_org_leave_another_orgs_assemblies_whole(stack: LocalStack) -> None:
    codes: list[int] = []
    results: list[AssembleResponse | IbexError] = []
    stop = asyncio.Event()
    async with AsyncClient(stack.frontends) as client:
        await client.wait_connected()

        async def assemble(i: int) -> None:
            try:
                results.append(await client.assemble(
                    org_id="globex", agent_id="research-agent", model="gpt-4.1-mini", timeout=TIMEOUT_S,
                    query="Summarise what we know about the literature review.",
                    recent_messages=[{"role": "user", "content": f"request {i}"}]))
            except IbexError as exc:
                results.append(exc)

        writers = [asyncio.create_task(writer(stack, n, stop, codes)) for n in range(WRITERS)]
        try:
            await eventually("acme's writes flowing", lambda: len(codes) >= WRITERS, timeout_s=60)
            for start in range(0, ASSEMBLIES, 4):
                await asyncio.gather(*(assemble(i) for i in range(start, start + 4)))
        finally:
            stop.set()
            await asyncio.gather(*writers)

    whole = [r for r in results if isinstance(r, AssembleResponse) and not r.degraded and r.packed]
    bad = [r.degraded_reasons if isinstance(r, AssembleResponse) else type(r).__name__
           for r in results if not (isinstance(r, AssembleResponse) and not r.degraded and r.packed)]
    print(f"\n  globex: {len(whole)}/{len(results)} whole; acme writes: {len(codes)}, "
          f"{ {c: codes.count(c) for c in set(codes)} }")
    assert len(results) == ASSEMBLIES
    assert len(whole) >= 0.95 * ASSEMBLIES, bad
    assert codes.count(201) >= WRITERS  # acme's writes were stored meanwhile
