"""The embedded Redis Cluster and the key layout on it: slots split over three primaries each with
a synced replica, an org's own keys on one slot, an agent's memory keys and its search index on one
shard, and untagged org keys of a single server moved to their tagged names once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import ibex_context.memory.embedded_redis.cluster as cluster_mod
from ibex_context.memory.embedded_redis.cluster import SLOTS, EmbeddedCluster
from ibex_context.memory.search.index import index_name
from ibex_context.shared.stores import keys
from ibex_context.shared.stores.connect import async_client, is_cluster, key_slot, sync_client
from ibex_context.shared.stores.layout_migration import MARKER_KEY, tag_org_keys


def test_cluster_covers_every_slot_with_a_replica_per_primary(redis_cluster: EmbeddedCluster) -> None:
    owned = 0
    for node in redis_cluster.primary_nodes:
        with node.client() as c:
            assert c.info("replication")["role"] == "master"
            assert c.info("replication")["connected_slaves"] == 1
    with redis_cluster.nodes[0].client() as c:
        info = c.execute_command("CLUSTER", "INFO")
        for lo, hi, *_ in c.execute_command("CLUSTER", "SLOTS"):
            owned += int(hi) - int(lo) + 1
    assert "cluster_state:ok" in info and "cluster_known_nodes:6" in info
    assert owned == SLOTS


def test_a_node_port_is_never_one_of_the_clusters_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel hands a port just released out again: nodes started one after another, none yet
    # bound, were given the same one (and the second exited with "Address already in use").
    taken = cluster_mod.cluster_port()
    fresh = cluster_mod.cluster_port([taken])
    offered: Iterator[int] = iter([taken, taken + 10000, taken - 10000, fresh])
    monkeypatch.setattr(cluster_mod, "free_port", lambda: next(offered))
    assert cluster_mod.cluster_port([taken]) == fresh


def test_an_orgs_own_keys_share_one_slot_and_an_agents_memory_keys_another() -> None:
    own = {keys.directive_key("acme", "bot"), keys.summary_key("acme", "bot", "c1"),
           keys.calibration_key("acme", "gpt-4o"), keys.assembly_key("acme", "a1"), keys.org_storage_key("acme"),
           keys.org_memory_agents_key("acme")}
    assert len({key_slot(k) for k in own}) == 1
    mem = {keys.memory_key("acme", "bot", "m1"), keys.memory_ids_key("acme", "bot"), keys.hot_key("acme", "bot"),
           index_name("hash", "acme", "bot", per_agent=True)}
    assert len({key_slot(k) for k in mem}) == 1
    # agents of one org spread over the slots
    assert len({key_slot(keys.memory_key("acme", f"agent{i}", "m1")) for i in range(50)}) > 40


def test_cluster_url_gives_cluster_clients(cluster_url: str, redis_url: str) -> None:
    with sync_client(cluster_url) as c, sync_client(redis_url) as s:
        assert is_cluster(c) and not is_cluster(s)
        for i in range(30):  # keys on every shard, read back through the slot routing
            c.set(keys.directive_key(f"org{i}", "bot"), f"v{i}")
        assert [c.get(keys.directive_key(f"org{i}", "bot")) for i in range(30)] == [f"v{i}".encode() for i in range(30)]


async def test_untagged_org_keys_of_a_single_server_move_to_their_tagged_names(redis_url: str) -> None:
    r = async_client(redis_url)
    try:
        await r.set("acme:directive:bot", b"old", ex=600)
        await r.hset("acme:calibration:gpt-4o", mapping={"n": 3})
        await r.hset("acme:storage", mapping={"b": 10})
        await r.set("{acme}:directive:bot2", b"new")
        await r.hset("mem:{acme:bot}:m1", mapping={"content": "kept"})
        await r.set("beta:directive:bot", b"beta's")
        await r.set("{beta}:directive:bot", b"written since")
        assert await tag_org_keys(r) == 3
        assert await r.get(keys.directive_key("acme", "bot")) == b"old"
        assert 0 < await r.ttl(keys.directive_key("acme", "bot")) <= 600
        assert await r.hget(keys.calibration_key("acme", "gpt-4o"), "n") == b"3"
        assert await r.hget(keys.org_storage_key("acme"), "b") == b"10"
        assert await r.hget("mem:{acme:bot}:m1", "content") == b"kept"
        assert await r.get(keys.directive_key("beta", "bot")) == b"written since"  # a newer key wins
        assert await r.get(MARKER_KEY) is not None
        await r.set("acme:directive:late", b"x")
        assert await tag_org_keys(r) == 0  # once: the marker is set
    finally:
        await r.aclose()


async def test_the_migration_leaves_a_cluster_alone(cluster_url: str) -> None:
    r = async_client(cluster_url)
    try:
        await r.set("acme:directive:bot", b"x")
        assert await tag_org_keys(r) == 0
        assert await r.get("acme:directive:bot") == b"x"
    finally:
        await r.aclose()


def test_a_one_primary_cluster_starts_and_stops_clean() -> None:
    cluster = EmbeddedCluster(primaries=1, replicas=0)
    try:
        cluster.start()
        with cluster.nodes[0].client() as c:
            assert "cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
    finally:
        cluster.stop()
    assert cluster.nodes == []
