"""One org cannot fill the store for the others (docs/security.md "Storage budgets").

A real Redis of its own with a small ``maxmemory`` and the real memory service on it. One org
writes to its budget three ways, with tiny memories, with texts of words the index has never seen,
and with compaction summaries through the worker's summary path; each is refused with the typed
error naming the setting while Redis is still under the memory write floor, the charges are never
below what Redis holds, and another org's memory writes, directive updates and summaries go on.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.shared.config.settings import WorkerSettings
from ibex_context.shared.stores.directives import set_directive
from ibex_context.shared.stores.keys import org_storage_key
from ibex_context.shared.wire.errors import ErrorCode
from ibex_context.shared.wire.summary_write import SummaryWrite
from ibex_context.worker.summaries import Summaries
from tests.fixtures_services import MemoryServiceHandle, memory_service_with

MAXMEMORY = 40 << 20
FLOOR = 0.90  # IBEX_MEMORY_WRITE_FLOOR_FRACTION's default
BUDGET = MAXMEMORY // 4  # IBEX_ORG_STORAGE_FRACTION's default share
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def small_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(maxmemory=MAXMEMORY) as server:
        yield server


@pytest.fixture(scope="module")
def service(small_redis: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceHandle]:
    with memory_service_with(small_redis.url, tmp_path_factory.mktemp("budgets")) as handle:
        yield handle


def _used(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return int(r.info("memory")["used_memory"])


def _charged(url: str, org: str) -> int:
    with redis.Redis.from_url(url) as r:
        return int(r.hget(org_storage_key(org), "total") or 0)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(7)) + "ing" for _ in range(n))


def _fill(http: httpx.Client, svc: MemoryServiceHandle, org: str, text: object, limit: int) -> httpx.Response:
    """Write memories of ``org`` until one is refused; that reply."""
    for i in range(limit):
        content = text(i) if callable(text) else str(text)
        r = http.post("/v1/memories", headers=svc.headers(org),
                      json={"agent_id": "bot", "content": content, "category": "fact"})
        if r.status_code != 201:
            return r
    raise AssertionError(f"{org} wrote {limit} memories without reaching its budget")


def _others_still_write(http: httpx.Client, svc: MemoryServiceHandle, url: str, n: int) -> None:
    r = http.post("/v1/memories", headers=svc.headers("bystander"),
                  json={"agent_id": "bot", "content": f"bystander note {n}: invoices go out monthly",
                        "category": "fact"})
    assert r.status_code == 201, r.text

    async def directive() -> None:
        client = AsyncRedis.from_url(url)
        try:
            env = await set_directive(client, "bystander", "bot", f"Directive revision {n}.")
            assert env.version == n
        finally:
            await client.aclose()

    asyncio.run(directive())


def _refused_before_floor(r: httpx.Response, url: str, org: str) -> None:
    assert r.status_code == 409, r.text
    assert r.json()["field"] == "IBEX_ORG_STORAGE_BYTES" and "IBEX_ORG_STORAGE_BYTES" in r.json()["error"]
    assert _charged(url, org) <= BUDGET
    assert _used(url) < FLOOR * MAXMEMORY  # nobody else's write was refused


def test_one_org_is_stopped_at_its_budget_and_the_others_go_on(small_redis: EmbeddedRedis,
                                                               service: MemoryServiceHandle) -> None:
    url, rng = small_redis.url, random.Random(11)
    with httpx.Client(base_url=service.url, timeout=30.0) as http:
        _others_still_write(http, service, url, 1)

        # (a) tiny memories: each is ~2.5 KB in Redis, not one byte
        r = _fill(http, service, "hog-tiny", lambda i: string.ascii_lowercase[i % 26], 5_000)
        _refused_before_floor(r, url, "hog-tiny")
        _others_still_write(http, service, url, 2)

        # (b) texts of words the index has never seen: ~550 bytes a word in the index
        before = _used(url)
        r = _fill(http, service, "hog-words", lambda i: _words(rng, 250), 500)
        _refused_before_floor(r, url, "hog-words")
        assert _used(url) - before <= _charged(url, "hog-words")  # charged at least what Redis holds
        _others_still_write(http, service, url, 3)

        # (c) compaction summaries, through the worker's summary path
        settings = WorkerSettings(redis_url=url)

        async def summaries() -> Summaries:
            s = Summaries(redis=AsyncRedis.from_url(url), settings=settings)
            try:
                for i in range(5_000):
                    write = SummaryWrite(request_id=f"r{i}", org_id="hog-summaries", agent_id="bot",
                                         deadline_ns=time.time_ns() + 10**10, summary_key=f"conv-{i}",
                                         text=_words(rng, 2_500), covers=2)
                    if not await s.store(write):
                        break
                assert await s.store(SummaryWrite(request_id="b1", org_id="bystander", agent_id="bot",
                                                  deadline_ns=time.time_ns() + 10**10, summary_key="conv",
                                                  text="The bystander's conversation so far.", covers=2))
            finally:
                await s.aclose()
            return s

        s = asyncio.run(summaries())
        assert s.stats["summary_refused_quota"] == 1 and s.stats["summary_stored"] > 100
        assert s.last_refusal is not None and s.last_refusal.code == ErrorCode.OVERLOADED
        assert s.last_refusal.field == "IBEX_ORG_STORAGE_BYTES"
        assert _charged(url, "hog-summaries") <= BUDGET
        assert _used(url) < FLOOR * MAXMEMORY
        _others_still_write(http, service, url, 4)

        # the hog stays refused until its data shrinks
        again = http.post("/v1/memories", headers=service.headers("hog-words"),
                          json={"agent_id": "bot", "content": _words(rng, 250), "category": "fact"})
        assert again.status_code == 409
