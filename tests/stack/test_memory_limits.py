"""Writes cannot break reads (docs/security.md "Degradation and security").

A write is validated before it is stored: ``created_at`` within [1900, 2200) UTC, content without
control characters other than tab, newline and carriage return, and at most
``IBEX_MEMORY_MAX_MEMORIES_PER_AGENT`` memories per agent. A record that is already stored and
does not validate (written straight to Redis here, with redis-py) is skipped by every read and
counted in ``/healthz``: the agent's reads stay 200. Real memory service, real Redis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from ibex_context.memory.search.index import tenant_number
from ibex_context.memory.store.records import MAX_CONTENT_CHARS
from ibex_context.shared.stores.keys import hot_key, memory_ids_key, memory_key
from tests.fixtures_services import MemoryServiceHandle

GOOD = "Invoices for the Acme account are emailed on the first of each month"


@pytest.fixture
def http(memory: MemoryServiceHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=memory.url, timeout=10.0, headers=memory.headers("acme")) as client:
        yield client


def write(http: httpx.Client, agent: str = "bot", **fields: Any) -> httpx.Response:
    return http.post("/v1/memories", json={"agent_id": agent, "content": GOOD, "category": "fact", **fields})


def hot_ids(http: httpx.Client, agent: str = "bot") -> list[str]:
    r = http.get("/v1/memories/hot", params={"agent_id": agent})
    assert r.status_code == 200, r.text
    return [h["memory_id"] for h in r.json()["memories"]]


def search_ids(http: httpx.Client, agent: str = "bot", query: str = GOOD) -> list[str]:
    r = http.post("/v1/memories/search", json={"query": query, "agent_id": agent, "min_similarity": 0.0})
    assert r.status_code == 200, r.text
    return [h["memory_id"] for h in r.json()["memories"]]


def counter(http: httpx.Client, name: str) -> int:
    n = http.get("/healthz").json()[name]
    assert isinstance(n, int)
    return n


def skipped(http: httpx.Client) -> int:
    return counter(http, "records_skipped")


# ---------------------------------------------------------------------------------- created_at


@pytest.mark.parametrize("created_at", [
    "0001-01-01T00:00:00+01:00",  # UTC is in year 0: astimezone() overflowed on every read
    "9999-12-31T23:59:59-01:00",  # UTC is in year 10000
    "0001-01-01T00:00:00Z",
    "1899-12-31T23:59:59.999Z",
    "2200-01-01T00:00:00Z",
    "2199-12-31T23:30:00-01:00",  # 2200-01-01T00:30Z
    "1900-01-01T00:30:00+01:00",  # 1899-12-31T23:30Z
])
def test_created_at_out_of_range_is_refused(http: httpx.Client, created_at: str) -> None:
    r = write(http, memory_id="m-bad", created_at=created_at, hot=True)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "created_at" and "1900" in r.json()["error"] and "2200" in r.json()["error"]
    assert hot_ids(http) == [] and search_ids(http) == []


@pytest.mark.parametrize("created_at,stored", [
    ("1900-01-01T00:00:00Z", "1900-01-01T00:00:00.000Z"),
    ("2199-12-31T23:59:59Z", "2199-12-31T23:59:59.000Z"),
    ("2200-01-01T00:30:00+01:00", "2199-12-31T23:30:00.000Z"),  # compared in UTC, not by its digits
])
def test_created_at_range_edges_are_accepted(http: httpx.Client, created_at: str, stored: str) -> None:
    assert write(http, memory_id="m-edge", created_at=created_at, hot=True).status_code == 201
    [h] = http.get("/v1/memories/hot", params={"agent_id": "bot"}).json()["memories"]
    assert h["created_at"] == stored
    assert search_ids(http) == ["m-edge"]


# ------------------------------------------------------------------------------------- content


@pytest.mark.parametrize("char", ["\x00", "\x01", "\x08", "\x0b", "\x0c", "\x1b", "\x1f", "\x7f", "\x80", "\x85",
                                  "\x9f"])
def test_control_characters_in_content_are_refused(http: httpx.Client, char: str) -> None:
    r = write(http, content=f"before{char}after")
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["field"] == "content" and f"U+{ord(char):04X} at position 6" in body["error"]


def test_tab_newline_and_cr_are_content(http: httpx.Client) -> None:
    text = "line one\twith a tab\r\nline two\nline three about invoices"
    assert write(http, memory_id="m-text", content=text, hot=True).status_code == 201
    [h] = http.get("/v1/memories/hot", params={"agent_id": "bot"}).json()["memories"]
    assert h["content"] == text


def test_control_character_flood_is_refused_and_reads_stay_small(http: httpx.Client) -> None:
    """The tester's case: 50 memories of 64,000 control characters made one search answer 19 MB."""
    statuses = {write(http, memory_id=f"m-{i}", content="\x01" * MAX_CONTENT_CHARS).status_code for i in range(50)}
    assert statuses == {400}
    assert write(http, memory_id="m-ok").status_code == 201
    r = http.post("/v1/memories/search", json={"query": GOOD, "agent_id": "bot", "min_similarity": 0.0})
    assert r.status_code == 200 and len(r.content) < 2_000, len(r.content)


# ------------------------------------------------------------------------ bad records already stored


def _overwrite(memory: MemoryServiceHandle, agent: str, mid: str, **changes: Any) -> None:
    """Replace a stored record's JSON in Redis, bypassing every check of the service."""
    key = memory_key("acme", agent, mid)
    with redis.Redis.from_url(memory.redis_url) as r:
        record = json.loads(r.hget(key, "rec"))
        record.update(changes)
        r.hset(key, "rec", json.dumps(record))


@pytest.mark.parametrize("changes", [
    {"created_at": "0001-01-01T00:00:00+01:00"},
    {"created_at": "9999-12-31T23:59:59-01:00"},
    {"content": "bad \x01 bytes"},
    {"confidence": float("nan")},
    {"memory_id": "someone-else"},
    {"category": "gossip"},
])
def test_bad_stored_record_is_skipped_and_counted(http: httpx.Client, memory: MemoryServiceHandle,
                                                  changes: dict[str, Any]) -> None:
    assert write(http, memory_id="m-good", hot=True).status_code == 201
    assert write(http, memory_id="m-bad", hot=True, salience=0.99).status_code == 201
    assert hot_ids(http) == ["m-bad", "m-good"] and sorted(search_ids(http)) == ["m-bad", "m-good"]
    _overwrite(memory, "bot", "m-bad", **changes)
    before = skipped(http)
    assert hot_ids(http) == ["m-good"]
    assert search_ids(http) == ["m-good"]
    assert skipped(http) == before + 2  # one per read that met it
    assert "m-bad" in memory.log_tail(20)


def test_unparseable_stored_records_are_skipped(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    assert write(http, memory_id="m-good", hot=True).status_code == 201
    with redis.Redis.from_url(memory.redis_url) as r:
        r.hset(memory_key("acme", "bot", "m-junk"), mapping={
            "org": "acme", "agent": "bot", "tenant": tenant_number("acme", "bot"), "content": GOOD, "created_at": 0,
            "rec": b"\xff{not json"})
        r.zadd(hot_key("acme", "bot"), {"m-junk": 1.0})
    before = skipped(http)
    assert hot_ids(http) == ["m-good"]
    assert search_ids(http) == ["m-good"]  # found by its words, skipped, never embedded
    assert skipped(http) >= before + 2


# ----------------------------------------------------------------------------- per-agent cap

CAP = 3


@pytest.fixture
def capped(redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=tmp_path,
                                 extra_env={"IBEX_MEMORY_MAX_MEMORIES_PER_AGENT": str(CAP)})
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def test_per_agent_cap(capped: MemoryServiceHandle) -> None:
    with httpx.Client(base_url=capped.url, timeout=10.0, headers=capped.headers("acme")) as http:
        for i in range(CAP):
            assert write(http, memory_id=f"m-{i}").status_code == 201
        r = write(http, memory_id="m-extra")
        assert r.status_code == 409, r.text
        assert r.json()["field"] == "agent_id" and f"cap is {CAP}" in r.json()["error"]
        assert write(http, memory_id="m-0", content="rewritten: invoices go out monthly").status_code == 201
        assert write(http, agent="other-bot", memory_id="m-extra").status_code == 201
        assert sorted(search_ids(http)) == ["m-0", "m-1", "m-2"]
    with httpx.Client(base_url=capped.url, timeout=10.0, headers=capped.headers("globex")) as http:
        assert write(http, memory_id="m-extra").status_code == 201  # another org's agent of the same name


async def test_per_agent_cap_holds_under_concurrent_writes(capped: MemoryServiceHandle) -> None:
    async with httpx.AsyncClient(base_url=capped.url, timeout=10.0, headers=capped.headers("acme")) as client:
        results = await asyncio.gather(*(
            client.post("/v1/memories", json={"agent_id": "race", "memory_id": f"m-{i}", "content": f"{GOOD} {i}",
                                              "category": "fact"})
            for i in range(12)
        ))
    codes = sorted(r.status_code for r in results)
    assert codes == [201] * CAP + [409] * (12 - CAP), [r.text for r in results]
    with redis.Redis.from_url(capped.redis_url) as r:
        assert r.scard(memory_ids_key("acme", "race")) == CAP


# ------------------------------------------------------------------------- large texts and answers


def test_large_texts_are_embedded_off_the_event_loop(http: httpx.Client) -> None:
    before = counter(http, "embeds_offloaded")
    assert write(http, memory_id="m-short").status_code == 201
    assert counter(http, "embeds_offloaded") == before  # a short text is cheaper than a thread hop
    assert write(http, memory_id="m-long", content=("invoice " * 1000).strip()).status_code == 201  # 7,999 chars
    assert counter(http, "embeds_offloaded") == before + 1
    assert "m-long" in search_ids(http, query="invoice")


ANSWER_CAP = 64 << 10


@pytest.fixture
def small_answers(redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=tmp_path,
                                 extra_env={"IBEX_MEMORY_MAX_ANSWER_BYTES": str(ANSWER_CAP)})
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def test_answers_end_before_max_answer_bytes(small_answers: MemoryServiceHandle) -> None:
    big = ("invoice " * 2_500).strip()  # ~20 KB a hit: three fit in 64 KiB, four do not
    with httpx.Client(base_url=small_answers.url, timeout=10.0, headers=small_answers.headers("acme")) as http:
        for i in range(5):
            assert write(http, memory_id=f"m-{i}", content=big, hot=True, salience=0.5 + i / 10).status_code == 201
        before = counter(http, "answers_trimmed")
        r = http.get("/v1/memories/hot", params={"agent_id": "bot"})
        assert r.status_code == 200 and len(r.content) <= ANSWER_CAP
        assert [h["memory_id"] for h in r.json()["memories"]] == ["m-4", "m-3", "m-2"]  # the top ranks stay
        assert [h["rank"] for h in r.json()["memories"]] == [1, 2, 3]
        r = http.post("/v1/memories/search", json={"query": "invoice", "agent_id": "bot"})
        assert r.status_code == 200 and len(r.content) <= ANSWER_CAP and len(r.json()["memories"]) == 3
        assert counter(http, "answers_trimmed") == before + 2
        assert len(http.get("/v1/memories/hot", params={"agent_id": "bot", "limit": 3}).json()["memories"]) == 3
        assert counter(http, "answers_trimmed") == before + 2  # what fits is not trimmed
