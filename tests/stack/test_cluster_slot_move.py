"""Moving the slot that holds an agent's memories to another primary (``ops.reshard.move_slots``,
what ``ibex-context cluster move-slots`` runs: the agent's index created on the target before the
keys move) under a light search load: searches never fail during the move, and after it every
memory is found on the new primary and new writes land there."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.search.index import index_name, total_results
from ibex_context.ops.reshard import GROUP, Access, Cluster, Node, _groups, connect, move_slots
from ibex_context.shared.stores.connect import key_slot, sync_client
from ibex_context.shared.stores.keys import agent_tag, directive_key, summary_key
from ibex_context.worker import rawredis
from tests.fixtures_cluster import started_cluster
from tests.fixtures_services import MemoryServiceHandle, running_memory_service

ORG, AGENT, N = "acme", "mover", 300
EMB = load_embedder("hash")  # the test memory services' embedder (tests/conftest.py)


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with started_cluster(primaries=3, replicas=0) as c:
        yield c


@pytest.fixture(scope="module")
def service(cluster: EmbeddedCluster) -> Iterator[MemoryServiceHandle]:
    with running_memory_service(cluster.url, "ibex-memsvc-slot-move-") as handle:
        yield handle


def _indexed(url: str, query: str) -> int:
    """Documents the agent's index matches for ``query`` (the engine's own count, on whichever shard)."""
    with sync_client(url) as r:
        reply = r.execute_command("FT.SEARCH", index_name(EMB.name, ORG, AGENT, per_agent=True), query,
                                  "LIMIT", "0", "0")
    return total_results(reply)


def test_a_slot_moves_with_its_index_and_searches_stay_whole_after(cluster: EmbeddedCluster,
                                                                   service: MemoryServiceHandle) -> None:
    service.seed([{"org_id": ORG, "agent_id": AGENT, "memory_id": f"m{i}", "category": "fact",
                   "content": f"ledger entry {i} token{i}x"} for i in range(N)])
    assert _indexed(cluster.url, "@content:ledger") == N
    slot = key_slot(agent_tag(ORG, AGENT))
    source = cluster.node_for_key(agent_tag(ORG, AGENT))
    target = next(n for n in cluster.primary_nodes if n is not source)
    statuses: list[int] = []
    found: list[int] = []  # hits per search during the move (reported: what callers see)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=service.url, headers=service.headers(ORG), timeout=10.0) as c:
            while not stop.is_set():
                r = c.post("/v1/memories/search", json={"query": "ledger entry", "agent_id": AGENT, "limit": 10})
                statuses.append(r.status_code)
                found.append(len(r.json().get("memories", [])) if r.status_code == 200 else -1)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        admin = connect(cluster.url)
        try:  # one key per MIGRATE: long enough for searches to overlap it
            report = move_slots(admin, [slot], admin.find(f"127.0.0.1:{target.port}"), batch=1,
                                progress=lambda _: None)
        finally:
            admin.close()
        moved = report.keys
    finally:
        stop.set()
        worker.join()
    assert moved >= N + 1  # the memories and the agent's id set
    assert report.indexes == 1 and report.slots_moved == 1  # the agent's index, before its keys
    assert cluster.node_for_key(agent_tag(ORG, AGENT)) is target
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert _indexed(cluster.url, "@content:ledger") == N
    with httpx.Client(base_url=service.url, headers=service.headers(ORG), timeout=10.0) as c:
        hits = c.post("/v1/memories/search", json={"query": "token123x", "agent_id": AGENT, "limit": 5}).json()
        assert [h["memory_id"] for h in hits["memories"]][:1] == ["m123"]
        w = c.post("/v1/memories", json={"agent_id": AGENT, "memory_id": "after", "content": "ledger moved",
                                         "category": "fact"})
        assert w.status_code == 201
    assert _indexed(cluster.url, "@content:ledger") == N + 1
    print(f"{len(statuses)} searches during the move of {moved} keys; hits per search (limit 10): "
          f"min {min(found)}, max {max(found)}, fewer than 10: {sum(f < 10 for f in found)}")


async def test_the_workers_directive_get_follows_ask_and_moved(cluster: EmbeddedCluster) -> None:
    """``worker.rawredis`` on a cluster: keys of every shard read by slot; a key whose slot is being
    moved (``ASK``), then has moved (``MOVED``, a stale slot map), still reads right."""
    keys = {directive_key(f"org{i}", "bot"): f"v{i}".encode() for i in range(40)}
    with sync_client(cluster.url) as r:
        for k, v in keys.items():
            r.set(k, v)
    conn = rawredis.Connection.for_url(cluster.url, max_idle=2)
    assert isinstance(conn, rawredis.ClusterConnection)
    try:
        assert [await conn.get(k) for k in keys] == list(keys.values())
        key = directive_key("org7", "bot")
        slot = key_slot(key)
        source = cluster.node_for_key(key)
        target = next(n for n in cluster.primary_nodes if n is not source)
        with target.client() as t, source.client() as s:
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
            s.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key)
        assert await conn.get(key) == b"v7"  # the source answers ASK: asked again on the target
        for node in cluster.primary_nodes:
            with node.client() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
        assert await conn.get(key) == b"v7"  # MOVED: the map is read again
        assert await conn.mget(key, summary_key("org7", "bot", "c1")) == [b"v7", None]
    finally:
        conn.close()


def test_slots_move_in_groups_of_one_source_and_consecutive_slots() -> None:
    """``move_slots`` cuts its slots into runs of consecutive slots of one owner, ``GROUP`` at most
    (each run's steps one pipeline per node): a gap, a change of owner or a full group starts a new one."""
    a = Node("a" * 40, "127.0.0.1", 1, True, False, set(range(0, 200)))
    b = Node("b" * 40, "127.0.0.1", 2, True, False, set(range(200, 400)))
    cluster = Cluster(access=Access(), entry="127.0.0.1:1", nodes=[a, b])
    slots = [*range(10, 10 + GROUP + 3), 150, 151, 198, 199, 200, 201]
    assert _groups(cluster, slots) == [list(range(10, 10 + GROUP)), list(range(10 + GROUP, 10 + GROUP + 3)),
                                       [150, 151], [198, 199], [200, 201]]
    assert _groups(cluster, [5]) == [[5]] and _groups(cluster, []) == []
