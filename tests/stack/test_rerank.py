"""The late-interaction rerank through the real services (minilm memory service, Redis and Redis
Cluster): a write stores the memory's token states and charges them to its org, a search reorders
its candidates by MaxSim and says so in each hit's ``rerank_score`` and in ``assemble --explain``,
memories without states (stored before, or damaged) keep their relevance, and weight 0 is the
search without the rerank."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis

from ibex_context.memory.embedders.config import EmbedderConfig
from ibex_context.memory.embedders.embed import Embedder, load_embedder
from ibex_context.memory.embedders.minilm import MiniLMEmbedder
from ibex_context.memory.embedders.token_states import ROW_BYTES, decode
from ibex_context.memory.service.seed import seed_records
from ibex_context.memory.store.records import MemoryRecord
from ibex_context.memory.store.writes import memory_charge
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.stores import storage
from ibex_context.shared.stores.connect import async_client
from ibex_context.shared.stores.keys import memory_key, states_field
from tests.fixtures_services import MemoryServiceHandle, flush_redis
from tests.forkserver import fork_server
from tests.helpers import cli_in_process, http, start_stack

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
EMBEDDER = MiniLMEmbedder().name  # the name every minilm runtime stores under
# The services' weights: ``auto`` picks whichever form measures faster at load, so two embedders
# loaded here could give the same text two slightly different vectors.
FP32 = EmbedderConfig(minilm_weights="fp32")


@cache
def _fp32_embedder() -> Embedder:
    """The seeding embedder, loaded once for the module: each load compiles the graph again (~1.6 s CPU)."""
    return load_embedder("minilm", FP32)


def _turn(mid: str, content: str, day: str) -> dict[str, Any]:
    return {"org_id": "acme", "agent_id": "chat", "memory_id": mid, "content": content, "category": "note",
            "confidence": 0.8, "created_at": f"{day}T10:00:00+00:00"}


TURNS = [
    _turn("t1", "Priya: I just got back from a trip to Lisbon with my sister.", "2023-07-04"),
    _turn("t2", "Jonah: I just got back from a trip to Lisbon with my dad.", "2023-07-04"),
    _turn("t3", "Priya: I finished reading a novel about lighthouses.", "2023-09-12"),
    _turn("t4", "Jonah: We adopted a rabbit called Basil.", "2024-02-20"),
    _turn("t5", "Priya: The weather was grey all week, so I stayed in and painted.", "2024-02-21"),
    _turn("t6", "Jonah: I cooked a paella for my neighbours.", "2023-11-02"),
    _turn("t7", "Priya: My sister is moving to Porto next spring for a new job.", "2024-03-01"),
    _turn("t8", "Jonah: Basil chewed through the charger cable again.", "2024-03-03"),
    _turn("t9", "Priya: I started pottery classes on Thursday evenings.", "2024-03-07"),
    _turn("t10", "Jonah: My dad taught me how to fix the bike's brakes.", "2024-03-09"),
    _turn("t11", "Priya: We are planning a weekend of hiking in the mountains.", "2024-03-12"),
    _turn("t12", "Jonah: The neighbours loved the paella and asked for the recipe.", "2023-11-03"),
]
QUESTIONS = ["Who went to Lisbon?", "What pet does Jonah have?", "What does Priya do on Thursdays?",
             "Who taught Jonah to repair things?", "What did the rabbit break?", "Where is Priya's sister moving?",
             "What food did Jonah make?", "What are Priya's hobbies?", "What did Priya read?"]


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_of(request: pytest.FixtureRequest) -> str:
    """A Redis server's URL, then a Redis Cluster's: every test here runs on both."""
    if request.param == "single":
        return str(request.getfixturevalue("redis_server").url)
    return str(request.getfixturevalue("redis_cluster").url)


@pytest.fixture(scope="module")
def services(redis_of: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, MemoryServiceHandle]]:
    """Three minilm memory services on the same store: the rerank at its defaults, off, and with at
    least 100 candidates compared (the most similar under the cosine cutoff join it). They start side
    by side: each spends seconds compiling its graph."""
    settings = {"on": {}, "off": {"IBEX_MEMORY_RERANK_WEIGHT": "0"},
                "joined": {"IBEX_MEMORY_RERANK_MIN_CANDIDATES": "100"}}
    minilm = {"IBEX_MEMORY_EMBEDDER": "minilm", "IBEX_MEMORY_MINILM_WEIGHTS": "fp32"}
    handles = {name: MemoryServiceHandle(redis_url=redis_of, workdir=tmp_path_factory.mktemp(name),
                                         extra_env={**minilm, **env})
               for name, env in settings.items()}
    fork_server()  # started here, on the main thread, which it must not outlive
    try:
        with concurrent.futures.ThreadPoolExecutor(len(handles)) as pool:
            for started in [pool.submit(h.start) for h in handles.values()]:
                started.result()
        yield handles
    finally:
        for h in handles.values():
            h.stop()


@pytest.fixture
def seeded(services: dict[str, MemoryServiceHandle], redis_of: str) -> dict[str, MemoryServiceHandle]:
    flush_redis(redis_of)
    asyncio.run(_seed(redis_of))
    return services


async def _seed(url: str) -> None:
    redis = async_client(url)
    try:
        await seed_records(redis, TURNS, embedder=_fp32_embedder())
    finally:
        await redis.aclose()


def _redis(url: str, fn: Any) -> Any:
    async def run() -> Any:
        redis: Redis = async_client(url)
        try:
            return await fn(redis)
        finally:
            await redis.aclose()

    return asyncio.run(run())


def _search(memory: MemoryServiceHandle, query: str) -> list[dict[str, Any]]:
    got = http().post(f"{memory.url}/v1/memories/search", headers=memory.headers("acme"), timeout=30.0,
                      json={"agent_id": "chat", "query": query, "min_similarity": 0.0})
    assert got.status_code == 200, got.text
    hits: list[dict[str, Any]] = got.json()["memories"]
    return hits


def _order(hits: list[dict[str, Any]]) -> list[tuple[str, float]]:
    return [(h["memory_id"], h["relevance"]) for h in hits]


def test_a_write_stores_token_states_and_charges_them(services: dict[str, MemoryServiceHandle], redis_of: str) -> None:
    flush_redis(redis_of)
    memory = services["on"]
    body = {"agent_id": "chat", "memory_id": "w1", "content": "Priya: my sister moved to Porto for a new job.",
            "category": "note", "created_at": "2024-03-01T10:00:00Z"}
    wrote = http().post(f"{memory.url}/v1/memories", headers=memory.headers("acme"), json=body, timeout=30.0)
    assert wrote.status_code == 201, wrote.text
    key = memory_key("acme", "chat", "w1")
    raw, rec, charged = _redis(redis_of, lambda r: r.hmget(key, [states_field(EMBEDDER), "rec", "q"]))
    states = decode(raw)
    tokens = _fp32_embedder().model.token_count(body["content"])  # type: ignore[attr-defined]
    assert states is not None and states.shape == (tokens, 64) and len(raw) == 2 + ROW_BYTES * tokens
    record = MemoryRecord.model_validate_json(rec)
    without = memory_charge("acme", "chat", record, hot=False, embedder_name=EMBEDDER, dim=384)
    with_states = memory_charge("acme", "chat", record, hot=False, embedder_name=EMBEDDER, dim=384,
                                state_bytes=len(raw))
    assert int(charged) == with_states >= without + len(raw)  # the states' bytes, and their field name
    assert _redis(redis_of, lambda r: storage.usage(r, "acme")) >= with_states


def test_the_rerank_reorders_and_reports_its_score(seeded: dict[str, MemoryServiceHandle], redis_of: str) -> None:
    on, off = seeded["on"], seeded["off"]
    changed = 0
    for q in QUESTIONS:
        reranked, plain = _search(on, q), _search(off, q)
        assert {h["memory_id"] for h in plain} <= {h["memory_id"] for h in reranked}  # none pushed under the floor
        assert all(0.0 <= h["rerank_score"] <= 1.0 for h in reranked)
        assert all("rerank_score" not in h for h in plain)
        changed += [m for m, _ in _order(reranked)] != [m for m, _ in _order(plain)]
    assert changed > 0  # the MaxSim moved some question's order


class _NoStates:
    """minilm as an embedder without token states: memories written as before states were kept."""

    def __init__(self) -> None:
        self.inner = _fp32_embedder()
        self.name, self.dim, self.blocking = self.inner.name, self.inner.dim, self.inner.blocking
        self.min_similarity = self.inner.min_similarity

    def embed(self, texts: Any) -> Any:
        return self.inner.embed(texts)


def test_weight_zero_is_the_search_without_the_rerank(services: dict[str, MemoryServiceHandle],
                                                      redis_of: str) -> None:
    """Weight 0 over memories with states gives the order a reranking service gives to memories
    stored without them (written before states were kept): the search as it was."""
    flush_redis(redis_of)

    async def seed_without_states() -> None:
        redis = async_client(redis_of)
        try:
            await seed_records(redis, TURNS, embedder=_NoStates())  # type: ignore[arg-type]
        finally:
            await redis.aclose()

    asyncio.run(seed_without_states())
    assert not _redis(redis_of, lambda r: r.hexists(memory_key("acme", "chat", "t1"), states_field(EMBEDDER)))
    without = {q: _order(_search(services["on"], q)) for q in QUESTIONS}
    flush_redis(redis_of)
    asyncio.run(_seed(redis_of))
    for q in QUESTIONS:
        hits = _search(services["off"], q)
        assert _order(hits) == without[q] and all("rerank_score" not in h for h in hits)


def test_a_memory_without_usable_states_keeps_its_relevance(seeded: dict[str, MemoryServiceHandle],
                                                            redis_of: str) -> None:
    """Missing, truncated or foreign bytes cost that memory its rerank only: never the search."""
    q = "Who went to Lisbon?"
    field = states_field(EMBEDDER)

    async def damage(r: Redis) -> None:
        raw = await r.hget(memory_key("acme", "chat", "t1"), field)
        await r.hset(memory_key("acme", "chat", "t1"), field, raw[:-1])  # truncated
        await r.hset(memory_key("acme", "chat", "t2"), field, b"\x07\x40garbage")  # another format
        await r.hdel(memory_key("acme", "chat", "t3"), field)  # stored before states were kept

    _redis(redis_of, damage)
    plain = {h["memory_id"]: h["relevance"] for h in _search(seeded["off"], q)}
    hits = {h["memory_id"]: h for h in _search(seeded["on"], q)}
    for mid in ("t1", "t2", "t3"):
        assert "rerank_score" not in hits[mid] and hits[mid]["relevance"] == plain[mid]
    assert sum("rerank_score" in h for h in hits.values()) >= 2  # the others are still reranked


# --------------------------------------------------------------------- a live assembly, explained


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # Deadlines far past a loaded machine's: this test is about what explain shows, not about time.
    # fp32 weights as the seeding embedder's (``auto`` would time both forms again at start).
    env = {"IBEX_MEMORY_EMBEDDER": "minilm", "IBEX_MEMORY_MINILM_WEIGHTS": "fp32", "IBEX_HEARTBEAT_INTERVAL_MS": "200",
           "IBEX_DIRECTIVE_TIMEOUT_MS": "10000",
           "IBEX_HOT_TIMEOUT_MS": "10000", "IBEX_COLD_TIMEOUT_MS": "10000", "IBEX_CONTEXT_DEADLINE_MS": "12000",
           "IBEX_RETRIEVAL_TIMEOUT_MS": "12000"}  # the retrieval wall is the lesser of the last two
    s = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=env, seed=False)
    try:
        asyncio.run(_seed(str(s.redis_url)))
        yield s
    finally:
        s.stop()


def test_explain_shows_the_rerank_score(stack: LocalStack) -> None:
    """The JSON from a real process; the table from the same command's ``main()`` in this process
    (``cli_in_process``): what it prints."""
    args = ["assemble", "--endpoint", stack.frontend, "--org", "acme", "--agent", "chat", "--model", "gpt-4o",
            "--query", "What did the rabbit break?", "--timeout-ms", "15000"]
    out = subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=90, check=False)
    assert out.returncode == 0, out.stderr
    packed = [d for d in json.loads(out.stdout)["decisions"] if d["decision"] == "packed" and d["source"] == "cold"]
    assert packed and all(0.0 <= d["retrieval"]["rerank"] <= 1.0 for d in packed)
    table = cli_in_process(*args, "--explain", env=dict(os.environ))
    assert table.returncode == 0, table.stderr
    assert "rerank score" in table.stdout


def test_every_runtime_gives_the_references_token_states() -> None:
    """The compiled graph's ``states`` output (on OpenVINO, as minilm runs here) is the numpy
    pass's, from the same pass as the vector, for memories and questions."""
    texts = [t["content"] for t in TURNS]
    fast, ref = load_embedder("minilm"), MiniLMEmbedder()
    got, want = fast.embed_with_states(texts), ref.embed_with_states(texts)  # type: ignore[attr-defined]
    assert np.allclose(got.vectors, fast.embed(texts), atol=1e-6)
    for a, b in zip(got.states, want.states, strict=True):
        da, db = decode(a), decode(b)
        assert da is not None and db is not None and da.shape == db.shape
        assert float(np.min(np.sum(da * db, axis=1) / np.linalg.norm(da, axis=1) / np.linalg.norm(db, axis=1))) > 0.99
    for (vec, rows), (ref_vec, ref_rows) in zip(fast.embed_queries_states(QUESTIONS),  # type: ignore[attr-defined]
                                                ref.embed_queries_states(QUESTIONS), strict=True):
        assert float(vec @ ref_vec) > 0.999 and rows.shape == ref_rows.shape
        assert float(np.min(np.sum(rows * ref_rows, axis=1))) > 0.99


def _search_body(memory: MemoryServiceHandle, query: str) -> dict[str, Any]:
    """The whole search answer at the embedder's own cosine cutoff (minilm 0.20)."""
    got = http().post(f"{memory.url}/v1/memories/search", headers=memory.headers("acme"), timeout=30.0,
                      json={"agent_id": "chat", "query": query})
    assert got.status_code == 200, got.text
    body: dict[str, Any] = got.json()
    return body


def test_candidates_under_the_cosine_cutoff_join_the_rerank(seeded: dict[str, MemoryServiceHandle]) -> None:
    """Fewer candidates than IBEX_MEMORY_RERANK_MIN_CANDIDATES pass the cutoff: the most similar under
    it are reranked too, and one stays only if the rerank lifts it to the cutoff; without the rerank
    they are shown under the line by their cosine alone."""
    q = "What pet does Jonah have?"
    on, off = _search_body(seeded["joined"], q), _search_body(seeded["off"], q)
    joined_below = [b for b in on["below_cutoff"] if "reranked to" in b["reason"]]
    assert joined_below and all("rerank_score" in b and b["vector_score"] < 0.2 and b["text_score"] == 0.0
                                for b in joined_below)
    for hit in on["memories"]:  # a hit that holds no question word reaches the cutoff, by cosine or rerank
        assert hit["text_score"] > 0.0 or hit["relevance"] >= 0.2
    assert not [b for b in off["below_cutoff"] if "reranked" in b["reason"] or "rerank_score" in b]
    under_off = {b["memory_id"] for b in off["below_cutoff"] if b["reason"].startswith("cosine")}
    assert under_off and under_off <= {b["memory_id"] for b in on["below_cutoff"]} | {
        h["memory_id"] for h in on["memories"]}
