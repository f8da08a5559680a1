"""Write quotas (``memory.store.quotas``): agents and storage (Redis bytes) per org, and a store near its maxmemory,
refuse writes with a typed error while reads go on and other orgs are untouched. Real memory
service, real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from ibex_context.shared.stores.keys import memory_key, org_storage_key
from ibex_context.shared.stores.storage import INDEX_BYTES
from tests.fixtures_services import MemoryServiceHandle, memory_service_with

BUDGET = INDEX_BYTES + 70_000  # the index and two memories of 40 distinct words (~27 KB each), not three


@pytest.fixture
def quota_service(redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    with memory_service_with(redis_url, tmp_path, IBEX_MEMORY_MAX_AGENTS_PER_ORG="2",
                             IBEX_ORG_STORAGE_BYTES=str(BUDGET)) as handle:
        handle.flush()
        yield handle


def _write(http: httpx.Client, svc: MemoryServiceHandle, org: str, agent: str, content: str,
           memory_id: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"agent_id": agent, "content": content, "category": "fact"}
    if memory_id:
        body["memory_id"] = memory_id
    return http.post("/v1/memories", headers=svc.headers(org), json=body)


def test_agents_per_org(quota_service: MemoryServiceHandle) -> None:
    with httpx.Client(base_url=quota_service.url, timeout=10.0) as http:
        assert _write(http, quota_service, "acme", "a1", "one").status_code == 201
        assert _write(http, quota_service, "acme", "a2", "two").status_code == 201
        r = _write(http, quota_service, "acme", "a3", "three")
        assert r.status_code == 409 and r.json()["field"] == "agent_id"
        assert "IBEX_MEMORY_MAX_AGENTS_PER_ORG" in r.json()["error"]
        assert _write(http, quota_service, "acme", "a1", "more for a known agent").status_code == 201
        assert _write(http, quota_service, "globex", "a3", "another org").status_code == 201


def test_storage_budget_counts_what_a_write_adds(quota_service: MemoryServiceHandle, redis_url: str) -> None:
    big = " ".join(f"word{i}x" for i in range(40))  # distinct words: each one a term of the index
    with httpx.Client(base_url=quota_service.url, timeout=10.0) as http:
        assert _write(http, quota_service, "acme", "bot", big, "m1").status_code == 201
        with redis.Redis.from_url(redis_url) as r:
            one = int(r.hget(memory_key("acme", "bot", "m1"), "q"))
            assert one > 40 * 600  # the words' terms, not the text's 300 bytes
        assert _write(http, quota_service, "acme", "bot", big, "m2").status_code == 201
        r3 = _write(http, quota_service, "acme", "bot", big, "m3")  # over INDEX_BYTES + 2.5 memories
        assert r3.status_code == 409 and r3.json()["field"] == "IBEX_ORG_STORAGE_BYTES"
        assert "IBEX_ORG_STORAGE_BYTES" in r3.json()["error"]
        assert _write(http, quota_service, "acme", "bot", big, "m1").status_code == 201  # a rewrite adds nothing
        assert _write(http, quota_service, "acme", "bot", "short", "m1").status_code == 201  # frees space
        assert _write(http, quota_service, "acme", "bot", big, "m3").status_code == 201
        assert _write(http, quota_service, "globex", "bot", big).status_code == 201  # its own budget
        hits = http.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=quota_service.headers("acme"))
        assert hits.status_code == 200  # reads go on
    with redis.Redis.from_url(redis_url) as r:
        charged = sum(int(r.hget(memory_key("acme", "bot", m), "q")) for m in ("m1", "m2", "m3"))
        assert int(r.hget(org_storage_key("acme"), "total")) == INDEX_BYTES + charged <= BUDGET


async def test_concurrent_writes_of_one_org_are_all_stored_and_counted(memory: MemoryServiceHandle,
                                                                        redis_url: str) -> None:
    memory.flush()
    async with httpx.AsyncClient(base_url=memory.url, timeout=30.0, headers=memory.headers("acme")) as client:
        replies = await asyncio.gather(*(client.post("/v1/memories", json={
            "agent_id": f"bot{i % 3}", "memory_id": f"m{i}", "content": f"note {i} " + "w" * 4000, "category": "fact"})
            for i in range(8)))
    assert [r.status_code for r in replies] == [201] * 8
    with redis.Redis.from_url(redis_url) as r:
        charged = sum(int(r.hget(memory_key("acme", f"bot{i % 3}", f"m{i}"), "q")) for i in range(8))
        assert int(r.hget(org_storage_key("acme"), "total")) == INDEX_BYTES + charged  # the index with the first


def test_a_nearly_full_store_refuses_writes_and_keeps_reads(memory: MemoryServiceHandle, redis_url: str) -> None:
    memory.flush()
    with httpx.Client(base_url=memory.url, timeout=10.0, headers=memory.headers("acme")) as http:
        assert http.post("/v1/memories", json={"agent_id": "bot", "content": "kept", "category": "fact",
                                               "hot": True}).status_code == 201
        with redis.Redis.from_url(redis_url) as r:
            before = r.config_get("maxmemory")["maxmemory"]
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", str(int(used / 0.95)))  # used is 95 % of it: over the 90 % floor
            try:
                time.sleep(1.1)  # the service reads the store's memory at most once a second
                w = http.post("/v1/memories", json={"agent_id": "bot", "content": "refused", "category": "fact"})
                assert w.status_code == 507 and "nearly full" in w.json()["error"]
                hot = http.get("/v1/memories/hot", params={"agent_id": "bot"})
                assert hot.status_code == 200 and [m["content"] for m in hot.json()["memories"]] == ["kept"]
                s = http.post("/v1/memories/search", json={"query": "kept", "agent_id": "bot"})
                assert s.status_code == 200
            finally:
                r.config_set("maxmemory", before)
        time.sleep(1.1)
        assert http.post("/v1/memories", json={"agent_id": "bot", "content": "accepted again",
                                               "category": "fact"}).status_code == 201


def test_the_embedded_server_has_a_maxmemory_and_never_evicts(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as r:
        assert int(r.config_get("maxmemory")["maxmemory"]) > 0
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
