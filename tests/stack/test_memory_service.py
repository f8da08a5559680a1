"""The reference memory service over real HTTP (uvicorn subprocess) and a real redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import ResponseError

from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.memory.search.index import index_name, tenant_number
from ibex_context.memory.service.seed import DEMO_FILE
from ibex_context.memory.service.seed import main as seed_main
from ibex_context.memory.service.server import main as server_main
from ibex_context.shared.stores.connect import is_cluster, sync_client
from ibex_context.shared.stores.keys import memory_key, vector_field
from tests.fixtures_services import MemoryServiceHandle
from tests.helpers import main_in_process

HIT_FIELDS = {"memory_id", "content", "category", "similarity", "confidence", "rank", "created_at",
              "usefulness", "access_count"}


def mem(org: str, agent: str, content: str, **kw: Any) -> dict[str, Any]:
    return {"org_id": org, "agent_id": agent, "content": content, "category": kw.pop("category", "fact"),
            "confidence": kw.pop("confidence", 0.8), **kw}


@pytest.fixture
def http(memory: MemoryServiceHandle) -> Any:
    with httpx.Client(base_url=memory.url, timeout=10.0) as client:
        yield client


def hot(http: httpx.Client, memory: MemoryServiceHandle, org: str, agent: str, **params: Any) -> httpx.Response:
    return http.get("/v1/memories/hot", params={"agent_id": agent, **params}, headers=memory.headers(org))


def search(http: httpx.Client, memory: MemoryServiceHandle, org: str, body: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/memories/search", json=body, headers=memory.headers(org))


def ids(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [h["memory_id"] for h in resp.json()["memories"]]


def assert_healthy(http: httpx.Client) -> None:
    r = http.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


# ------------------------------------------------------------------------------- happy paths


COUNTERS = ("records_skipped", "queries_truncated", "embeds_offloaded", "answers_trimmed", "common_words_scored",
            "deadline_dropped", "embeds_refused", "queries_bulk", "searches_waited",
            "searches_refused")


def test_healthz(http: httpx.Client) -> None:
    body = http.get("/healthz").json()
    assert body == {"embedder": "hash1-256", "embedder_runtime": None, "embedder_weights": None,
                    "faults_enabled": True, "status": "ok",
                    "redis": "ok", **{k: body[k] for k in COUNTERS}}
    assert all(isinstance(body[k], int) and body[k] >= 0 for k in COUNTERS)


def test_write_then_read_back(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    r = http.post("/v1/memories", headers=memory.headers("acme"), json={
        "agent_id": "bot", "memory_id": "m-1", "content": "User prefers dark mode in every dashboard",
        "category": "preference", "confidence": 0.9, "usefulness": 0.7, "hot": True, "salience": 0.66,
        "created_at": "2026-01-02T03:04:05Z",
    })
    assert r.status_code == 201 and r.json() == {"memory_id": "m-1", "agent_id": "bot", "hot": True}
    [h] = hot(http, memory, "acme", "bot").json()["memories"]
    assert set(h) == HIT_FIELDS
    assert h == {"memory_id": "m-1", "content": "User prefers dark mode in every dashboard",
                 "category": "preference", "similarity": 0.66, "confidence": 0.9, "rank": 1,
                 "created_at": "2026-01-02T03:04:05.000Z", "usefulness": 0.7, "access_count": 0}
    [s] = search(http, memory, "acme", {"query": "dark mode dashboard", "agent_id": "bot"}).json()["memories"]
    assert s["memory_id"] == "m-1" and s["rank"] == 1 and 0.5 <= s["similarity"] <= 1.0
    # Written again without the hot flag: it leaves the hot set but stays searchable.
    r = http.post("/v1/memories", headers=memory.headers("acme"), json={
        "agent_id": "bot", "memory_id": "m-1", "content": "User prefers dark mode", "category": "preference"})
    assert r.status_code == 201
    assert ids(hot(http, memory, "acme", "bot")) == []
    assert ids(search(http, memory, "acme", {"query": "dark mode", "agent_id": "bot"})) == ["m-1"]


def test_search_sees_every_write(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    def put(content: str) -> None:
        r = http.post("/v1/memories", headers=memory.headers("acme"),
                      json={"agent_id": "bot", "memory_id": "m-1", "content": content, "category": "fact"})
        assert r.status_code == 201

    put("alpha bravo charlie")
    assert ids(search(http, memory, "acme", {"query": "alpha bravo charlie", "agent_id": "bot"})) == ["m-1"]
    put("delta echo foxtrot")  # same id, same record count: the cached index must not be reused
    assert ids(search(http, memory, "acme", {"query": "alpha bravo charlie", "agent_id": "bot"})) == []
    assert ids(search(http, memory, "acme", {"query": "delta echo foxtrot", "agent_id": "bot"})) == ["m-1"]
    memory.flush()
    memory.seed([mem("acme", "bot", "golf hotel india", memory_id="m-1")])
    assert ids(search(http, memory, "acme", {"query": "delta echo foxtrot", "agent_id": "bot"})) == []
    assert ids(search(http, memory, "acme", {"query": "golf hotel india", "agent_id": "bot"})) == ["m-1"]


def test_hot_orders_by_salience_and_caps_at_limit(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.seed([mem("acme", "bot", f"hot memory number {i}", memory_id=f"h{i:02d}", hot=True,
                     salience=round(i / 30, 3)) for i in range(30)]
                + [mem("acme", "bot", "cold only", memory_id="cold")])
    got = hot(http, memory, "acme", "bot").json()["memories"]
    assert [h["memory_id"] for h in got] == [f"h{i:02d}" for i in range(29, 9, -1)]  # default limit 20
    assert [h["rank"] for h in got] == list(range(1, 21))
    assert got[0]["similarity"] == pytest.approx(29 / 30, abs=1e-3)
    assert ids(hot(http, memory, "acme", "bot", limit=3)) == ["h29", "h28", "h27"]
    assert ids(hot(http, memory, "acme", "bot", limit=0)) == []


def test_search_fuses_text_and_vector_then_floor_and_composite(http: httpx.Client,
                                                                memory: MemoryServiceHandle) -> None:
    memory.seed([
        mem("acme", "bot", "Invoices are emailed monthly as PDF attachments", memory_id="exact"),
        mem("acme", "bot", "Customer wants the monthly invoice as a PDF please", memory_id="keyword"),
        mem("acme", "bot", "The office plants need watering on Tuesdays", memory_id="unrelated"),
        mem("acme", "bot", "Old task about invoices PDF emailed monthly", memory_id="old-task",
            category="task", age_days=90),
    ])
    q = "Invoices are emailed monthly as PDF attachments"
    hits = search(http, memory, "acme", {"query": q, "agent_id": "bot"}).json()["memories"]
    by_id = {h["memory_id"]: h for h in hits}
    # Every word matched, cosine 1: relevance 1.
    assert by_id["exact"]["similarity"] == pytest.approx(1.0, abs=1e-4)
    assert by_id["exact"]["text_score"] > 0.8 and by_id["exact"]["vector_score"] == pytest.approx(1.0, abs=1e-4)
    # Every hit's relevance is the fusion of its two scores (docs/memory-search.md).
    for h in hits:
        v = h["vector_score"]
        assert h["relevance"] == pytest.approx(v + 0.8 * h["text_score"] * (1 - v), abs=2e-6)
        assert h["similarity"] == h["relevance"] == h["components"]["relevance"]
    keyword = by_id["keyword"]  # shares words, cosine under the 0.70 cutoff: in by its text score
    assert 0.0 < keyword["text_score"] < 1.0 and keyword["vector_score"] < 0.70
    assert keyword["relevance"] > keyword["vector_score"]  # lifted by the words it holds
    assert "unrelated" not in by_id  # no shared word, cosine under the cutoff
    assert [h["rank"] for h in hits] == list(range(1, len(hits) + 1))
    assert hits[0]["memory_id"] == "exact"
    assert by_id["old-task"]["rank"] > by_id["exact"]["rank"]  # a 90-day-old task has decayed (7 d half-life)
    # With the cutoff disabled, weak cosines come through only above the 0.15 relevance floor.
    loose = search(http, memory, "acme", {"query": q, "agent_id": "bot", "min_similarity": 0.0}).json()
    assert all(h["similarity"] >= 0.15 for h in loose["memories"])
    assert "unrelated" not in {h["memory_id"] for h in loose["memories"]}
    assert ids(search(http, memory, "acme", {"query": q, "agent_id": "bot", "limit": 1})) == ["exact"]
    assert ids(search(http, memory, "acme", {"query": q, "agent_id": "bot", "limit": 0})) == []
    assert ids(search(http, memory, "acme", {"query": "", "agent_id": "bot"})) == []


def test_unknown_agent_is_an_empty_list(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    assert ids(hot(http, memory, "acme", "nobody")) == []
    assert ids(search(http, memory, "acme", {"query": "anything at all", "agent_id": "nobody"})) == []


def test_searches_of_agents_with_no_memories_make_no_index_each(http: httpx.Client,
                                                                memory: MemoryServiceHandle) -> None:
    """Naming agent after agent costs the service a count, not an index each: on a cluster (an index
    per agent) a search of an agent with no memories makes none; on one server at most the org's."""
    org = f"idle-{secrets.token_hex(4)}"
    name = http.get("/healthz").json()["embedder"]
    with sync_client(memory.redis_url) as r:
        per_agent = is_cluster(r)

        def indexed(agent: str) -> bool:
            try:
                r.execute_command("FT.INFO", index_name(name, org, agent, per_agent=per_agent))
            except ResponseError:
                return False
            return True

        for i in range(5):
            assert ids(search(http, memory, org, {"query": f"anything at all {i}", "agent_id": f"agent-{i}"})) == []
        assert not any(indexed(f"agent-{i}") for i in range(5)) if per_agent else indexed("agent-0")
        memory.seed([mem(org, "agent-0", "The idle org's first memory", memory_id="first")])
        assert indexed("agent-0") and not (per_agent and indexed("agent-1"))  # a write makes the agent's
    assert ids(search(http, memory, org, {"query": "the idle org's first memory", "agent_id": "agent-0"})) == ["first"]


def test_records_without_vectors_are_backfilled(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    record = {"memory_id": "raw-1", "content": "Shipping labels print from the warehouse portal",
              "category": "fact", "confidence": 0.9, "created_at": "2026-01-01T00:00:00Z"}
    hand_written = {"org": "acme", "agent": "bot", "tenant": tenant_number("acme", "bot"), "content": record["content"],
                    "created_at": 1767225600, "rec": json.dumps(record)}
    memory.seed([mem("acme", "bot", "Zebra crossings", memory_id="anchor")])  # the agent's index exists
    with sync_client(memory.redis_url) as r:
        r.hset(memory_key("acme", "bot", "raw-1"), mapping=hand_written)  # no vector
        r.hset(memory_key("acme", "bot", "broken"), mapping={**hand_written, "rec": b"{not json"})
        got = search(http, memory, "acme", {"query": "print shipping labels warehouse", "agent_id": "bot"})
        assert ids(got) == ["raw-1"]
        field = vector_field(http.get("/healthz").json()["embedder"])
        assert r.hexists(memory_key("acme", "bot", "raw-1"), field)  # stored: the vector side finds it now
        assert not r.hexists(memory_key("acme", "bot", "broken"), field)
    assert ids(search(http, memory, "acme", {"query": "warehouse portal labels", "agent_id": "bot"})) == ["raw-1"]


# ---------------------------------------------------------------------------------- tenancy


def test_org_a_never_sees_org_b(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    shared_words = "refund policy for annual plans is thirty days"
    memory.seed([
        mem("acme", "support-bot", f"ACME secret: {shared_words}", memory_id="acme-1", hot=True),
        mem("globex", "support-bot", f"GLOBEX secret: {shared_words}", memory_id="globex-1", hot=True),
        mem("globex", "support-bot", f"GLOBEX only: {shared_words} extra", memory_id="acme-1-lookalike"),
    ])
    for org, mine in (("acme", {"acme-1"}), ("globex", {"globex-1", "acme-1-lookalike"})):
        got_hot = hot(http, memory, org, "support-bot").json()["memories"]
        got_search = search(http, memory, org, {"query": shared_words, "agent_id": "support-bot",
                                                "min_similarity": 0.0}).json()["memories"]
        for hits in (got_hot, got_search):
            assert {h["memory_id"] for h in hits} <= mine
            other = "GLOBEX" if org == "acme" else "ACME"
            assert not any(other in h["content"] for h in hits)
        assert {h["memory_id"] for h in got_search} == mine
    # The org can only come from the token: naming another one is refused, not obeyed.
    r = hot(http, memory, "acme", "support-bot", org_id="globex")
    assert r.status_code == 400 and "token" in r.json()["error"]
    r = search(http, memory, "acme", {"query": "x", "agent_id": "support-bot", "org_id": "globex"})
    assert r.status_code == 400 and "token" in r.json()["error"]


def test_demo_dataset_tenancy_marker(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    lines = [json.loads(line) for line in DEMO_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    stats = memory.seed(lines)
    assert stats.orgs == ("acme", "globex") and stats.directives >= 6 and stats.memories >= 300
    for org, other in (("acme", "globex"), ("globex", "acme")):
        hits = search(http, memory, org, {"query": "TENANT-MARKER this memory belongs", "agent_id": "support-bot",
                                          "min_similarity": 0.0}).json()["memories"]
        text = " ".join(h["content"] for h in hits)
        assert f"belongs to {org} only" in text and f"belongs to {other} only" not in text
    # Hostile memories are served verbatim: escaping is the formatter's job, not the store's.
    everything = search(http, memory, "acme", {"query": "memory system developer mode instructions",
                                               "agent_id": "support-bot", "min_similarity": 0.0})
    assert everything.status_code == 200


# ------------------------------------------------------------------------------------- auth


@pytest.mark.parametrize("auth", [None, "", "Bearer", "Bearer nonsense", "Basic dXNlcjpwYXNz",
                                  "Bearer ibex1.acme." + "0" * 64])
def test_bad_credentials_are_401(http: httpx.Client, auth: str | None) -> None:
    headers = {"authorization": auth} if auth is not None else {}
    for r in (http.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=headers),
              http.post("/v1/memories/search", json={"query": "x", "agent_id": "bot"}, headers=headers),
              http.post("/v1/memories", json={"agent_id": "bot", "content": "x", "category": "fact"},
                        headers=headers)):
        assert r.status_code == 401 and "error" in r.json(), r.text
        assert r.headers["www-authenticate"] == "Bearer"


def test_token_from_another_secret_is_401(http: httpx.Client) -> None:
    from ibex_context.shared.security.tenancy import mint_org_token

    forged = mint_org_token("not-the-service-secret", "acme")
    r = http.get("/v1/memories/hot", params={"agent_id": "bot"}, headers={"authorization": f"Bearer {forged}"})
    assert r.status_code == 401


# -------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("params,fragment", [
    ({"agent_id": "bot", "limit": 21}, "limit"),
    ({"agent_id": "bot", "limit": 10**30}, "limit"),
    ({"agent_id": "bot", "limit": -1}, "limit"),
    ({"agent_id": "bot", "limit": "ten"}, "limit"),
    ({"agent_id": "bot", "limit": "٣"}, "limit"),  # a non-ASCII digit
    ({"agent_id": "a:b"}, "agent_id"),
    ({"agent_id": "x" * 65}, "agent_id"),
    ({"agent_id": ""}, "agent_id"),
    ({}, "agent_id"),
    ({"agent_id": "bot", "colour": "blue"}, "unknown query parameter"),
    ({"agent_id": ["a", "b"]}, "more than once"),
])
def test_bad_hot_requests_are_400(http: httpx.Client, memory: MemoryServiceHandle, params: dict[str, Any],
                                  fragment: str) -> None:
    r = http.get("/v1/memories/hot", params=params, headers=memory.headers("acme"))
    assert r.status_code == 400 and fragment in r.json()["error"], r.text


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "malformed JSON"),
    (b"", "JSON object"),
    (b"[1, 2]", "JSON object"),
    (b'"a string"', "JSON object"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": NaN}', "NaN"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": Infinity}', "Infinity"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": -Infinity}', "Infinity"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": 1e999}', "out of range"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": 1.5}', "min_similarity"),
    (b'{"query": "x", "agent_id": "bot", "min_similarity": "0.5"}', "min_similarity"),
    (b'{"query": "x", "agent_id": "bot", "limit": 51}', "limit"),
    (b'{"query": "x", "agent_id": "bot", "limit": 100000000000000000000000}', "limit"),
    (b'{"query": "x", "agent_id": "bot", "limit": "5"}', "limit"),
    (b'{"query": "x", "agent_id": "bot", "limit": true}', "limit"),
    (b'{"query": "x", "agent_id": "bot", "limit": 5.5}', "limit"),
    (b'{"query": 5, "agent_id": "bot"}', "query"),
    (b'{"query": "x", "agent_id": ["bot"]}', "agent_id"),
    (b'{"query": "x", "agent_id": "../../etc"}', "agent_id"),
    (b'{"query": "x"}', "agent_id"),
    (b'{"query": "x", "agent_id": "bot", "extra": 1}', "extra"),
    (b'{"query": "\\ud800", "agent_id": "bot"}', "query"),
    (b"\xff\xfe\x00garbage", "malformed JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    (b'{"query": "x", "agent_id": "bot", "limit": ' + b"9" * 5000 + b"}", "malformed JSON"),
])
def test_bad_search_bodies_are_400(http: httpx.Client, memory: MemoryServiceHandle, body: bytes,
                                   fragment: str) -> None:
    r = http.post("/v1/memories/search", content=body,
                  headers={**memory.headers("acme"), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"], r.text
    assert_healthy(http)


def test_oversized_body_is_413(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    big = {"query": "x" * (2 << 20), "agent_id": "bot"}
    r = http.post("/v1/memories/search", json=big, headers=memory.headers("acme"))
    assert r.status_code == 413 and "error" in r.json()
    assert_healthy(http)


@pytest.mark.parametrize("body,fragment", [
    ({"agent_id": "bot", "content": "x", "category": "gossip"}, "category"),
    ({"agent_id": "bot", "content": "", "category": "fact"}, "content"),
    ({"agent_id": "bot", "content": "x", "category": "fact", "confidence": 1.5}, "confidence"),
    ({"agent_id": "bot", "content": "x", "category": "fact", "created_at": "yesterday"}, "created_at"),
    ({"agent_id": "bot", "content": "x", "category": "fact", "created_at": "2026-01-01T00:00:00"}, "created_at"),
    ({"agent_id": "bot", "content": "x", "category": "fact", "memory_id": "a b"}, "memory_id"),
    ({"agent_id": "bot", "content": "x", "category": "fact", "org_id": "globex"}, "token"),
    ({"agent_id": "bot", "content": "x" * 64_001, "category": "fact"}, "content"),
])
def test_bad_writes_are_400(http: httpx.Client, memory: MemoryServiceHandle, body: dict[str, Any],
                            fragment: str) -> None:
    r = http.post("/v1/memories", json=body, headers=memory.headers("acme"))
    assert r.status_code == 400 and fragment in r.json()["error"], r.text


def test_unknown_paths_and_methods_are_json(http: httpx.Client) -> None:
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = http.delete("/v1/memories/hot")
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize("method,path", [("GET", "/v1/memories/hot/"), ("POST", "/v1/memories/search/"),
                                         ("POST", "/v1/memories/"), ("GET", "/healthz/"), ("GET", "//healthz")])
def test_trailing_slash_is_404_not_a_redirect_to_the_host_header(http: httpx.Client, memory: MemoryServiceHandle,
                                                                 method: str, path: str) -> None:
    r = http.request(method, path, params={"agent_id": "bot"}, json={"query": "x", "agent_id": "bot"},
                     headers={**memory.headers("acme"), "host": "evil.example"})
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}, r.text
    assert "location" not in r.headers


# ------------------------------------------------------------------------ outages and restarts


def test_redis_outage_is_503_then_recovers(http: httpx.Client, memory: MemoryServiceHandle,
                                           redis_server: EmbeddedRedis) -> None:
    memory.seed([mem("acme", "bot", "survives nothing: redis keeps no data", hot=True)])
    redis_server.stop()
    try:
        t0 = time.monotonic()
        r = hot(http, memory, "acme", "bot")
        assert r.status_code == 503 and r.json() == {"error": "memory store unavailable"}
        assert time.monotonic() - t0 < 2.0  # fast failure, no retry backoff
        assert search(http, memory, "acme", {"query": "x y", "agent_id": "bot"}).status_code == 503
        assert http.get("/healthz").status_code == 503
    finally:
        redis_server.start()  # same port
    assert_healthy(http)
    assert ids(hot(http, memory, "acme", "bot")) == []  # nothing persisted, but serving again


def test_service_kill_and_restart_keep_the_url(memory: MemoryServiceHandle) -> None:
    url = memory.url
    memory.kill()
    assert not memory.running
    with httpx.Client(timeout=2.0) as client:
        with pytest.raises(httpx.ConnectError):
            client.get(f"{url}/healthz")
        memory.start()
        assert memory.url == url and client.get(f"{url}/healthz").status_code == 200
        memory.restart()
        assert client.get(f"{url}/healthz").status_code == 200


# ----------------------------------------------------------------------------------- faults


def test_fault_latency(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.set_fault("hot", latency_ms=400)
    with httpx.Client(base_url=memory.url, timeout=0.1) as fast:
        with pytest.raises(httpx.ReadTimeout):
            fast.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=memory.headers("acme"))
        t0 = time.monotonic()
        r = fast.post("/v1/memories/search", json={"query": "x", "agent_id": "bot"}, headers=memory.headers("acme"))
        assert r.status_code == 200 and time.monotonic() - t0 < 0.1  # the other endpoint is unaffected
    t0 = time.monotonic()
    assert hot(http, memory, "acme", "bot").status_code == 200  # latency alone: a late but normal reply
    assert time.monotonic() - t0 >= 0.4


def test_fault_status(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.set_fault("search", status=503)
    r = search(http, memory, "acme", {"query": "x", "agent_id": "bot"})
    assert r.status_code == 503 and r.json() == {"error": "injected fault: status 503"}
    assert hot(http, memory, "acme", "bot").status_code == 200


def test_fault_malformed(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.set_fault("hot", malformed=True)
    r = hot(http, memory, "acme", "bot")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    with pytest.raises(json.JSONDecodeError):
        r.json()


def test_fault_drop(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.set_fault("search", drop=True)
    # closed without a response: a clean close or a reset (RST), depending on timing
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        search(http, memory, "acme", {"query": "x", "agent_id": "bot"})
    assert hot(http, memory, "acme", "bot").status_code == 200
    assert "Traceback" not in memory.log_tail(200)


def test_a_caller_that_leaves_mid_body_is_no_error(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    """A worker whose branch deadline passes closes its connection, possibly before the body is
    sent: the service logs one line (499), not an unhandled-error traceback, and keeps serving."""
    import socket

    head = (f"POST /v1/memories/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: {memory.headers('acme')['authorization']}\r\nContent-Length: 1000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", memory.port), timeout=5) as s:
        s.sendall(head.encode() + b'{"query": "x", ')
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while "POST /v1/memories/search 499" not in memory.log_tail(50) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "POST /v1/memories/search 499" in memory.log_tail(50)
    assert "Traceback" not in memory.log_tail(200)
    assert search(http, memory, "acme", {"query": "x", "agent_id": "bot"}).status_code == 200


def test_fault_huge(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    memory.set_fault("hot", huge=True)
    r = hot(http, memory, "acme", "bot")
    assert r.status_code == 200 and len(r.content) >= 12 << 20
    assert len(r.json()["memories"]) > 100  # valid JSON, just far too big
    memory.set_fault("hot", huge=True, huge_bytes=2 << 20)
    assert 2 << 20 <= len(hot(http, memory, "acme", "bot").content) < 3 << 20


def test_fault_all_switching_and_validation(http: httpx.Client, memory: MemoryServiceHandle) -> None:
    state = memory.set_fault("all", status=500)
    assert set(state) == {"hot", "search"} and state["hot"]["status"] == 500
    assert hot(http, memory, "acme", "bot").status_code == 500
    assert search(http, memory, "acme", {"query": "x", "agent_id": "bot"}).status_code == 500
    memory.clear_faults("hot")
    assert hot(http, memory, "acme", "bot").status_code == 200
    assert http.get("/_faults").json() == {"faults": {"search": state["search"]}}
    memory.clear_faults()
    assert search(http, memory, "acme", {"query": "x", "agent_id": "bot"}).status_code == 200
    for bad in ({"endpoint": "write"}, {"endpoint": "hot", "status": 200}, {"endpoint": "hot", "latency_ms": -1},
                {"endpoint": "hot", "bogus": True}):
        r = http.put("/_faults", json=bad)
        assert r.status_code == 400, r.text
    r = http.put("/_faults", content=b'{"endpoint": "hot", "latency_ms": NaN}')
    assert r.status_code == 400 and "NaN" in r.json()["error"]


@pytest.mark.parametrize("auth", [None, "Bearer nonsense"])
def test_token_is_checked_before_any_fault(http: httpx.Client, memory: MemoryServiceHandle,
                                           auth: str | None) -> None:
    memory.set_fault("all", status=503)
    headers = {"authorization": auth} if auth is not None else {}
    for r in (http.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=headers),
              http.post("/v1/memories/search", json={"query": "x", "agent_id": "bot"}, headers=headers)):
        assert r.status_code == 401 and "injected" not in r.text, r.text
    assert hot(http, memory, "acme", "bot").status_code == 503  # a valid token does meet the fault


def test_faults_are_off_unless_enabled(redis_url: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        handle = MemoryServiceHandle(redis_url=redis_url, enable_faults=False, workdir=Path(tmp))
        handle.start()
        try:
            with httpx.Client(base_url=handle.url, timeout=5) as client:
                assert client.put("/_faults", json={"endpoint": "hot", "status": 500}).status_code == 404
                assert client.get("/healthz").json()["faults_enabled"] is False
        finally:
            handle.stop()


# -------------------------------------------------------------------------- startup and seed


def _env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    base["IBEX_MEMORY_EMBEDDER"] = os.environ.get("IBEX_MEMORY_EMBEDDER", "hash")  # tests/conftest.py
    return base


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"ibex_context.{module}", *args], capture_output=True, text=True,
                          env={**_env(), **(env or {})}, timeout=60)


@pytest.mark.parametrize("how", [["--relevance-floor", "0.5"], ["--relevance-floor", "0.9"], []])
def test_relevance_floor_at_or_above_half_is_refused_at_startup(how: list[str], redis_url: str) -> None:
    args = ("--port", "0", "--redis-url", redis_url, *how)
    if how:
        r = _run("memory.service.server", *args)
    else:  # the variable is refused before anything starts: the service's main in this process
        r = main_in_process(server_main, *args, env={**_env(), "IBEX_MEMORY_RELEVANCE_FLOOR": "0.5"})
    assert r.returncode == 2, r.stderr
    assert "relevance floor" in r.stderr and "0.5" in r.stderr


def _seed_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The seed tool's ``main`` in this process (tests.helpers.main_in_process), in ``_run``'s environment."""
    return main_in_process(seed_main, *args, env=_env())


def test_seed_cli(redis_url: str, tmp_path: Path) -> None:
    """A real process seeds, and one refuses a bad line with status 2; the same tool's other runs
    (re-seeding, another bad line, no Redis) go through its ``main`` in this process."""
    r = _run("memory.service.seed", "--redis-url", redis_url)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["orgs"] == ["acme", "globex"] and out["memories"] >= 300 and out["directives"] >= 6
    again = _seed_in_process("--redis-url", redis_url, "--flush-orgs")
    assert again.returncode == 0 and json.loads(again.stdout)["memories"] == out["memories"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"org_id": "acme", "agent_id": "bot", "content": "ok", "category": "fact"}\n'
                   '{"org_id": "acme", "agent_id": "bot", "content": "x", "category": "fact", "confidence": NaN}\n')
    r = _run("memory.service.seed", "--redis-url", redis_url, "--file", str(bad))
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr
    bad.write_text('{"org_id": "ac:me", "agent_id": "bot", "content": "x", "category": "fact"}\n')
    r = _seed_in_process("--redis-url", redis_url, "--file", str(bad))
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "org_id" in r.stderr
    assert _seed_in_process().returncode == 2  # no Redis named anywhere


# ------------------------------------------------------------------------- async, both loops


async def test_concurrent_clients(memory: MemoryServiceHandle) -> None:
    memory.seed([mem("acme", "bot", f"Fact {i} about the invoice schedule", hot=i % 2 == 0) for i in range(40)])
    async with httpx.AsyncClient(base_url=memory.url, timeout=10.0, headers=memory.headers("acme")) as client:
        results = await asyncio.gather(*(
            client.post("/v1/memories/search", json={"query": f"invoice schedule fact {i}", "agent_id": "bot"})
            if i % 2 else client.get("/v1/memories/hot", params={"agent_id": "bot"})
            for i in range(40)
        ))
    assert all(r.status_code == 200 for r in results)
    assert all(len(r.json()["memories"]) == 20 for r in results[::2])


@pytest.fixture
def approximate(redis_url: str, tmp_path: Path) -> Any:
    """A service that gives every agent the HNSW graph's approximate vector search."""
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=tmp_path, extra_env={"IBEX_MEMORY_EXACT_KNN_MAX": "0"})
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def test_approximate_vector_search_stays_in_the_agent_and_sees_writes(approximate: MemoryServiceHandle) -> None:
    approximate.flush()
    approximate.seed([mem("acme", "bot", f"note {i} about the quarterly invoice run", memory_id=f"b{i}")
                      for i in range(40)]
                     + [mem("acme", "other", f"note {i} about the quarterly invoice run", memory_id=f"o{i}")
                        for i in range(40)]
                     + [mem("globex", "bot", "note about the quarterly invoice run", memory_id="g0")])
    with httpx.Client(base_url=approximate.url, timeout=10.0) as http:
        body = {"query": "quarterly invoice run", "agent_id": "bot", "limit": 50, "min_similarity": 0.0}
        got = ids(search(http, approximate, "acme", body))
        assert len(got) == 40 and all(m.startswith("b") for m in got)  # never the other agent or org
        r = http.post("/v1/memories", headers=approximate.headers("acme"),
                      json={"agent_id": "bot", "memory_id": "fresh", "content": "zebra crossing permits renewed",
                            "category": "fact"})
        assert r.status_code == 201
        found = ids(search(http, approximate, "acme", {"query": "zebra crossing permits", "agent_id": "bot"}))
        assert found[0] == "fresh"
