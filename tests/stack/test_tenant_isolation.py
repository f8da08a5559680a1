"""One tenant cannot degrade the others through the memory service (docs/security.md "Degradation and security").

A search embeds and matches only the first ``IBEX_MEMORY_MAX_QUERY_CHARS`` characters of its
query (the wire allows 100,000; a 300 KB CJK query used to cost the service ~160 ms of its event
loop), large texts are embedded in a worker thread, and each org has at most
``IBEX_MEMORY_MAX_CONCURRENT_PER_ORG`` searches and writes computing at once.

The stack test runs the real broker, workers, memory service and Redis: one org sends assemblies
with maximum-size queries while another sends normal ones; the normal ones must all come back
undegraded.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.memory.service.app import OrgLimiter
from ibex_context.memory.service.config import DEFAULT_MAX_QUERY_CHARS
from ibex_context.memory.service.models import MAX_QUERY_CHARS
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from tests.fixtures_services import MemoryServiceHandle
from tests.helpers import start_stack


def cjk(n: int, seed: int) -> str:
    """``n`` random CJK ideographs: the dearest text per byte for the hashing embedder (no repeats)."""
    rng = random.Random(seed)
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(n))


# ------------------------------------------------------------------------ the query cap, over HTTP


@pytest.fixture
def http(memory: MemoryServiceHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=memory.url, timeout=30.0, headers=memory.headers("acme")) as client:
        yield client


def search(http: httpx.Client, query: str) -> list[dict[str, Any]]:
    r = http.post("/v1/memories/search", json={"query": query, "agent_id": "bot", "min_similarity": 0.0})
    assert r.status_code == 200, r.text
    hits: list[dict[str, Any]] = r.json()["memories"]
    return hits


def truncated(http: httpx.Client) -> int:
    n = http.get("/healthz").json()["queries_truncated"]
    assert isinstance(n, int)
    return n


def test_only_the_first_max_query_chars_are_embedded_and_matched(http: httpx.Client) -> None:
    for i, text in enumerate(["Invoices are emailed monthly as PDF attachments",
                              "The office plants need watering on Tuesdays",
                              "发票每月通过电子邮件发送"]):
        r = http.post("/v1/memories", json={"agent_id": "bot", "memory_id": f"m-{i}", "content": text,
                                            "category": "fact"})
        assert r.status_code == 201, r.text
    head = ("invoices emailed monthly PDF " * 100)[:DEFAULT_MAX_QUERY_CHARS]
    assert len(head) == DEFAULT_MAX_QUERY_CHARS
    before = truncated(http)
    expected = search(http, head)
    assert expected and expected[0]["memory_id"] == "m-0"
    assert truncated(http) == before  # at the cap: nothing cut
    # Whatever follows the cap changes nothing: not the vector, not the full-text terms, not the ranks.
    for seed, tail in enumerate([cjk(MAX_QUERY_CHARS - DEFAULT_MAX_QUERY_CHARS, 1),
                                 "发票每月通过电子邮件发送 " * 10, "office plants watering Tuesdays"]):
        assert search(http, head + tail) == expected, seed
    assert truncated(http) == before + 3
    # The maximum the wire allows (300 KB of CJK) is answered like any other query.
    assert len((head + cjk(MAX_QUERY_CHARS - DEFAULT_MAX_QUERY_CHARS, 1)).encode()) > 290_000


def test_a_short_query_is_not_cut(http: httpx.Client) -> None:
    r = http.post("/v1/memories", json={"agent_id": "bot", "memory_id": "m-cjk", "content": "发票每月通过电子邮件发送",
                                        "category": "fact"})
    assert r.status_code == 201
    before = truncated(http)
    assert [h["memory_id"] for h in search(http, "发票每月通过电子邮件发送")] == ["m-cjk"]
    assert truncated(http) == before


async def test_org_limiter_holds_one_org_and_not_the_others() -> None:
    limiter = OrgLimiter(2)
    release, four_inside = asyncio.Event(), asyncio.Event()
    inside: list[str] = []

    async def work(org: str) -> None:
        async with limiter.hold(org):
            inside.append(org)
            if len(inside) == 4:
                four_inside.set()
            await release.wait()

    acme = [asyncio.create_task(work("acme")) for _ in range(5)]  # started first, and queued first
    globex = [asyncio.create_task(work("globex")) for _ in range(2)]
    await asyncio.wait_for(four_inside.wait(), 5)
    assert sorted(inside) == ["acme", "acme", "globex", "globex"]  # acme 3-5 wait; globex did not
    release.set()
    await asyncio.gather(*acme, *globex)
    assert inside.count("acme") == 5 and len(limiter) == 0  # idle orgs leave nothing behind


# ----------------------------------------------------------------------------- the real stack

# Branch timeouts far above a normal search (~2 ms) so a loaded 2-core box does not degrade the
# normal requests by itself, and below what four senders of 300 KB queries used to stall the
# service for (each query held its event loop for 160-660 ms; before the fix 24 of 24 degraded).
ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_WORKER_CONCURRENCY": "16", "IBEX_DIRECTIVE_TIMEOUT_MS": "500",
       "IBEX_HOT_TIMEOUT_MS": "500", "IBEX_COLD_TIMEOUT_MS": "500", "IBEX_CONTEXT_TIMEOUT": "1500",
       "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30"}
HUGE_SENDERS = 4
NORMAL_REQUESTS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("isolation"), workers=2, env=ENV)
    try:
        yield s
    finally:
        s.stop()


async def test_huge_queries_of_one_org_do_not_degrade_another(stack: LocalStack) -> None:
    normal: list[AssembleResponse | IbexError] = []
    huge: list[AssembleResponse | IbexError] = []
    first_huge_done = asyncio.Event()
    normal_done = asyncio.Event()

    async with AsyncClient(stack.frontends) as client:
        await client.wait_connected()

        async def huge_sender(n: int) -> None:
            i = 0
            while not normal_done.is_set():
                query = cjk(MAX_QUERY_CHARS, seed=n * 1000 + i)  # a fresh text each time: no warm cache
                try:
                    huge.append(await client.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o",
                                                      query=query, timeout=3.0))
                except IbexError as exc:
                    huge.append(exc)
                first_huge_done.set()
                i += 1

        async def normal_sender(i: int) -> None:
            try:
                normal.append(await client.assemble(
                    org_id="globex", agent_id="research-agent", model="gpt-4.1-mini", timeout=3.0,
                    query="Summarise what we know about the literature review.",
                    recent_messages=[{"role": "user", "content": f"request {i}"}]))
            except IbexError as exc:
                normal.append(exc)

        senders = [asyncio.create_task(huge_sender(n)) for n in range(HUGE_SENDERS)]
        await asyncio.wait_for(first_huge_done.wait(), 30)  # acme's load is flowing
        for start in range(0, NORMAL_REQUESTS, 4):
            await asyncio.gather(*(normal_sender(i) for i in range(start, start + 4)))
        normal_done.set()
        await asyncio.gather(*senders)

    print(f"\n  huge: {len(huge)} replies; normal: {len(normal)}")
    assert len(normal) == NORMAL_REQUESTS
    errors = [r for r in normal if isinstance(r, IbexError)]
    assert errors == []
    degraded = [r.degraded_reasons for r in normal if isinstance(r, AssembleResponse) and r.degraded]
    assert degraded == []
    assert all(isinstance(r, AssembleResponse) and r.packed for r in normal)
    assert len(huge) >= HUGE_SENDERS  # acme was served too, all through the normal requests
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(stack.memory_url + "/healthz")).json()["queries_truncated"] > 0
