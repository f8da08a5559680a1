"""Search's stages through the real services: each hit's stage scores (full text, vector, subject
boost), the memories about a person the question names lifted, dates and stems matched by words, the
candidates under the search's line sent with their scores, and ``assemble --explain`` / ``--json``
showing both on a live assembly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from ibex_context.memory.service.seed import seed_records
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.stores.keys import memory_key
from tests.fixtures_services import MemoryServiceHandle
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def _turn(mid: str, content: str, day: str, **kw: Any) -> dict[str, Any]:
    return {"org_id": "acme", "agent_id": "chat", "memory_id": mid, "content": content, "category": "note",
            "confidence": 0.8, "created_at": f"{day}T10:00:00+00:00", **kw}


TURNS = [
    _turn("p-trip", "Priya: I just got back from a trip to Lisbon with my sister.", "2023-07-04"),
    _turn("j-trip", "Jonah: I just got back from a trip to Lisbon with my dad.", "2023-07-04"),
    _turn("p-book", "Priya: I finished reading a novel about lighthouses.", "2023-09-12"),
    _turn("j-pet", "Jonah: We adopted a rabbit called Basil.", "2024-02-20"),
    _turn("note", "The weather was grey all week.", "2024-02-21"),
    _turn("j-cook", "Jonah: I cooked a paella for my neighbours.", "2023-11-02"),
]


def _search(memory: MemoryServiceHandle, query: str, **kw: Any) -> dict[str, Any]:
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        got = http.post("/v1/memories/search", headers=memory.headers("acme"),
                        json={"agent_id": "chat", "query": query, **kw})
    assert got.status_code == 200, got.text
    doc: dict[str, Any] = got.json()
    return doc


def test_hits_carry_stage_scores_and_the_named_person_is_lifted(memory: MemoryServiceHandle) -> None:
    memory.seed(TURNS)
    doc = _search(memory, "Who went to Lisbon with Jonah?", min_similarity=0.0)
    hits = {h["memory_id"]: h for h in doc["memories"]}
    jonah, priya = hits["j-trip"], hits["p-trip"]
    assert jonah["boost"] > 0.0 and priya["boost"] == 0.0  # the question names Jonah, who said j-trip
    for h in (jonah, priya):
        assert 0.0 < h["text_score"] <= 1.0 and 0.0 <= h["vector_score"] <= 1.0 and h["relevance"] == h["similarity"]
    assert jonah["relevance"] > priya["relevance"] and doc["memories"][0]["memory_id"] == "j-trip"


def test_a_writers_subject_is_used_and_dates_match_by_their_words(memory: MemoryServiceHandle) -> None:
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:
        wrote = http.post("/v1/memories", headers=memory.headers("acme"), json={
            "agent_id": "chat", "memory_id": "dana", "content": "Allergic to peanuts, carries an epipen",
            "category": "fact", "subject": "Dana", "created_at": "2024-03-05T09:00:00Z"})
    assert wrote.status_code == 201, wrote.text
    memory.seed(TURNS)
    about = {h["memory_id"]: h for h in _search(memory, "What is Dana allergic to?")["memories"]}
    assert about["dana"]["boost"] > 0.0
    dated = {h["memory_id"]: h for h in _search(memory, "What happened in September 2023?")["memories"]}
    assert dated["p-book"]["text_score"] > 0.0  # its content names no date: the indexed day does
    assert all(h["text_score"] == 0.0 for m, h in dated.items() if m != "p-book")
    stemmed = {h["memory_id"]: h for h in _search(memory, "Who adopts rabbits?")["memories"]}
    assert stemmed["j-pet"]["text_score"] > 0.0  # "adopted a rabbit": the index stems English words


def test_a_memory_indexed_without_its_date_is_still_found(memory: MemoryServiceHandle) -> None:
    """Memories stored before the date was indexed (their ``content`` field holds the content only)
    are searched as they are: found by their words and vectors, not by their date."""
    memory.seed(TURNS)

    async def undate() -> None:
        redis = Redis.from_url(memory.redis_url)
        try:
            await redis.hset(memory_key("acme", "chat", "p-book"), "content", TURNS[2]["content"])
        finally:
            await redis.aclose()

    asyncio.run(undate())
    by_words = {h["memory_id"]: h for h in _search(memory, "novel about lighthouses")["memories"]}
    assert by_words["p-book"]["text_score"] > 0.5
    by_date = {h["memory_id"]: h for h in _search(memory, "What happened in September 2023?")["memories"]}
    assert by_date.get("p-book", {"text_score": 0.0})["text_score"] == 0.0


def test_candidates_under_the_line_come_with_scores_and_reasons(memory: MemoryServiceHandle) -> None:
    memory.seed(TURNS)
    doc = _search(memory, "trip to Lisbon", limit=1, min_similarity=0.0)
    assert len(doc["memories"]) == 1 and doc["memories"][0]["memory_id"] in {"j-trip", "p-trip"}
    below = doc["below_cutoff"]
    assert 1 <= len(below) <= 5 and {below[0]["memory_id"], doc["memories"][0]["memory_id"]} == {"j-trip", "p-trip"}
    assert below[0]["reason"] == "ranked 2, after the 1 hits the search returns"
    assert below[0]["composite"] <= doc["memories"][0]["composite"]
    for row in below:
        assert {"memory_id", "content", "reason", "text_score", "vector_score", "boost"} <= row.keys()
    strict = _search(memory, "trip to Lisbon", min_similarity=0.99)
    under = [r for r in strict["below_cutoff"] if r["reason"].startswith("cosine")]
    assert under and "under the cutoff 0.99 and it holds no word of the question" in under[0]["reason"]
    assert not {r["memory_id"] for r in under} & {h["memory_id"] for h in strict["memories"]}


# --------------------------------------------------------------------- a live assembly, explained


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
           "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_COLD_LIMIT": "2"}
    s = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=env, seed=False)
    try:
        async def seed() -> None:
            redis = Redis.from_url(str(s.redis_url))
            try:
                await seed_records(redis, TURNS)
            finally:
                await redis.aclose()

        asyncio.run(seed())
        yield s
    finally:
        s.stop()


def _assemble(stack: LocalStack, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "assemble", "--endpoint", stack.frontend,
                           "--org", "acme", "--agent", "chat", "--model", "gpt-4o", "--query",
                           "Who went to Lisbon with Jonah?", "--timeout-ms", "5000", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)


def test_explain_shows_stage_scores_and_below_cutoff_candidates(stack: LocalStack) -> None:
    out = _assemble(stack, "--json")
    assert out.returncode == 0, out.stderr
    decisions = json.loads(out.stdout)["decisions"]
    packed = [d for d in decisions if d["decision"] == "packed" and d["source"] == "cold"]
    below = [d for d in decisions if d["decision"] == "below_cutoff"]
    assert len(packed) == 2 and below  # the worker asked for two: the rest are under the line
    assert {"text", "vector", "boost"} <= packed[0]["retrieval"].keys()
    assert any(d["memory_id"] == "j-trip" and d["retrieval"]["boost"] > 0.0 for d in packed)
    assert all(d["reason"].startswith("under the search's line: ") for d in below)
    assert {"text", "vector", "boost", "relevance", "composite"} <= below[0]["retrieval"].keys()
    assert not {d["memory_id"] for d in below} & {d["memory_id"] for d in packed}
    table = _assemble(stack, "--explain")
    assert table.returncode == 0, table.stderr
    assert "below_cutoff" in table.stdout and "under the search's line: ranked 3" in table.stdout
    assert "boost score" in table.stdout
