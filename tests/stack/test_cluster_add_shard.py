"""``ibex-context cluster add-shard`` and ``move-slots`` on the embedded 3 + 3 cluster plus one empty
node (``ops.reshard``): the command, run as a subprocess, moves a quarter of the slots to the new
node with every moved agent's index created there first; afterwards every agent's search is whole,
no key is lost and new writes land on the new shard. An interrupted move is finished by running the
command again, and careless input is one line with the right exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from ibex_context.memory.embedded_redis.cluster import ClusterNode, EmbeddedCluster
from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.search.index import index_name, total_results
from ibex_context.ops.reshard import SlotMover, connect, join, move_slots
from ibex_context.shared.stores.connect import async_client, key_slot, sync_client
from ibex_context.shared.stores.keys import agent_tag
from tests.fixtures_cluster import started_cluster
from tests.fixtures_services import MemoryServiceHandle, running_memory_service
from tests.helpers import cli_in_process

pytestmark = pytest.mark.timeout(300)  # a whole slot move under searches: ~1 min idle, several on a busy box

ORG, PER_AGENT = "acme", 12
EMB = load_embedder("hash")  # the test memory services' embedder (tests/conftest.py)
# Agents chosen so some live in the slots add-shard moves (the top quarter of each primary's
# range: 4096-5460, 9557-10922, 15019-16383) and some do not.
AGENTS = [f"a{i}" for i in range(24)]
# One larger agent in a slot add-shard moves, moved one key per MIGRATE below: the searches of a
# service that knew only the first three primaries meet ASK to the new node for a while.
BIG = next(f"big{i}" for i in range(10_000) if 4200 <= key_slot("{" + f"{ORG}:big{i}" + "}") <= 5400)
BIG_N = 300


def _start_cli(*args: str) -> subprocess.Popen[str]:
    """``ibex-context cluster ARGS`` as a real process, started (``_finished`` waits for it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    return subprocess.Popen([sys.executable, "-m", "ibex_context.ops.cli", "cluster", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _finished(_start_cli(*args))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """``ibex-context cluster ARGS`` through the CLI's ``main()`` in this process (what it says and
    returns; ``_cli`` runs the real process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    return cli_in_process("cluster", *args, env=env)


def _addr(node: ClusterNode) -> str:
    return f"127.0.0.1:{node.port}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with started_cluster(primaries=3, replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def service(cluster: EmbeddedCluster) -> Iterator[MemoryServiceHandle]:
    with running_memory_service(cluster.url, "ibex-memsvc-add-shard-") as handle:
        yield handle


def _indexed(url: str, agent: str) -> int:
    """The agent's memories its index matches (the engine's own count, on whichever shard)."""
    with sync_client(url) as r:
        reply = r.execute_command("FT.SEARCH", index_name(EMB.name, ORG, agent, per_agent=True), "@content:note",
                                  "LIMIT", "0", "0")
    return total_results(reply)


def _keys(cluster: EmbeddedCluster) -> int:
    total = 0
    for node in cluster.nodes:
        with node.client() as c:
            if node.running and c.info("replication").get("role") == "master":
                total += int(c.dbsize())
    return total


def _search_top(service: MemoryServiceHandle, agent: str, query: str) -> list[str]:
    with httpx.Client(base_url=service.url, headers=service.headers(ORG), timeout=10.0) as c:
        r = c.post("/v1/memories/search", json={"query": query, "agent_id": agent, "limit": 3})
        assert r.status_code == 200, r.text
        return [h["memory_id"] for h in r.json()["memories"]]


def test_add_shard_moves_a_quarter_with_indexes_first_and_loses_nothing(cluster: EmbeddedCluster,
                                                                          service: MemoryServiceHandle) -> None:
    service.seed([{"org_id": ORG, "agent_id": a, "memory_id": f"m{i}", "category": "fact",
                   "content": f"note {i} about {a} code{a}x{i}"} for a in AGENTS for i in range(PER_AGENT)])
    service.seed([{"org_id": ORG, "agent_id": BIG, "memory_id": f"b{i}", "category": "fact",
                   "content": f"note {i} of the big one"} for i in range(BIG_N)])
    before = _keys(cluster)
    spare = cluster.spare_node()
    statuses: list[int] = []  # searches of every agent while the slots move (the service knew 3 primaries)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=service.url, headers=service.headers(ORG), timeout=10.0) as c:
            while not stop.is_set():
                for a in [BIG, *AGENTS[:3]]:
                    r = c.post("/v1/memories/search", json={"query": "note", "agent_id": a, "limit": 5})
                    statuses.append(r.status_code)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        out = _cli("add-shard", "--url", cluster.url, "--node", _addr(spare), "--batch", "1")
    finally:
        stop.set()
        worker.join()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("moved 4096 slots with ") and "to 127.0.0.1:" in out.stdout, out.stdout
    assert "slots (" in out.stderr and "Traceback" not in out.stderr, out.stderr  # progress lines
    assert cluster.node_for_key(agent_tag(ORG, BIG)) is spare
    assert _indexed(cluster.url, BIG) == BIG_N
    moved = [a for a in AGENTS if cluster.node_for_key(agent_tag(ORG, a)) is spare]
    stayed = [a for a in AGENTS if a not in moved]
    assert len(moved) >= 3 and len(stayed) >= 3, moved
    assert _keys(cluster) == before  # no key lost (the spare is a primary now, counted)
    for a in AGENTS:
        assert _indexed(cluster.url, a) == PER_AGENT, a
        assert _search_top(service, a, f"code{a}x5")[:1] == ["m5"], a
    with spare.client() as c:
        for a in moved:
            assert c.execute_command("FT.INFO", index_name(EMB.name, ORG, a, per_agent=True))
    again = _cli("add-shard", "--url", cluster.url, "--node", _addr(spare))  # idempotent: nothing left to do
    assert again.returncode == 0 and again.stdout.startswith("moved 0 slots with 0 keys"), (again.stdout, again.stderr)
    with httpx.Client(base_url=service.url, headers=service.headers(ORG), timeout=10.0) as c:
        w = c.post("/v1/memories", json={"agent_id": moved[0], "memory_id": "late", "content": "note written late",
                                         "category": "fact"})
        assert w.status_code == 201, w.text
    with spare.client() as c:
        assert c.exists(f"mem:{agent_tag(ORG, moved[0])}:late") == 1
    assert _indexed(cluster.url, moved[0]) == PER_AGENT + 1


def test_an_interrupted_move_is_finished_by_running_the_command_again(cluster: EmbeddedCluster,
                                                                        service: MemoryServiceHandle) -> None:
    """A move stopped after its first batch (slot left migrating, half the keys moved) is finished
    by ``move-slots`` run again; moving the slot back to a primary that kept the old index
    definition works too."""
    agent = "resumer"
    service.seed([{"org_id": ORG, "agent_id": agent, "memory_id": f"r{i}", "category": "fact",
                   "content": f"note resumed {i}"} for i in range(40)])
    slot = key_slot(agent_tag(ORG, agent))
    source = cluster.node_for_key(agent_tag(ORG, agent))
    target = next(n for n in cluster.primary_nodes if n is not source)
    # An agent of the same slot whose memories have no index on the source: the move gives it one
    # on the target (one per embedder in use) before its keys go.
    bare = next(f"bare{i}" for i in range(200_000) if key_slot(agent_tag(ORG, f"bare{i}")) == slot)
    service.seed([{"org_id": ORG, "agent_id": bare, "memory_id": f"x{i}", "category": "fact",
                   "content": f"note bare {i}"} for i in range(15)])
    with source.client() as s:
        s.execute_command("FT.DROPINDEX", index_name(EMB.name, ORG, bare, per_agent=True))
    admin = connect(cluster.url)
    try:  # the first steps of a move, then stop as if interrupted
        mover = SlotMover(admin, admin.find(_addr(target)), batch=10)
        mover.prepare([slot])
        with target.client() as t, source.client() as s:
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", admin.find(_addr(source)).node_id)
            assert mover.ensure(index_name(EMB.name, ORG, agent, per_agent=True)) == 1
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", admin.find(_addr(target)).node_id)
            keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 20)
            s.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        mover.close()
    finally:
        admin.close()
    out = _cli("move-slots", "--url", cluster.url, "--to", _addr(target), "--slots", str(slot))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("moved 1 slots with ") and "created 1 memory indexes" in out.stdout, out.stdout
    assert cluster.node_for_key(agent_tag(ORG, agent)) is target
    assert _indexed(cluster.url, agent) == 40
    assert _indexed(cluster.url, bare) == 15
    back = _cli("move-slots", "--url", cluster.url, "--to", _addr(source), "--from", _addr(target),
                "--slots", f"{slot}-{slot}")
    assert back.returncode == 0, back.stderr
    assert cluster.node_for_key(agent_tag(ORG, agent)) is source
    assert _indexed(cluster.url, agent) == 40
    assert _search_top(service, agent, "resumed 17")[:1] == ["r17"]


def _one_line(out: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ibex-context cluster "), out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)


def test_careless_input_is_one_line(cluster: EmbeddedCluster, redis_url: str) -> None:
    url = cluster.url
    # The real processes (one exit 1, one exit 2) touch no node of this cluster: they run while the
    # cases below run in this process (the unreachable one spends seconds in its client's retries).
    real = [_start_cli("move-slots", "--url", "redis+cluster://127.0.0.1:1/0", "--to", "127.0.0.1:2", "--slots", "1"),
            _start_cli("add-shard", "--url", url, "--node", "nohost")]
    try:
        _careless_in_process(cluster, redis_url)
    finally:
        unreachable, no_host = (_finished(p) for p in real)
    _one_line(unreachable, 1, "does not answer")
    _one_line(no_host, 2, "not HOST:PORT")


def _careless_in_process(cluster: EmbeddedCluster, redis_url: str) -> None:
    url = cluster.url
    primary, replica = cluster.primary_nodes[0], cluster.nodes[cluster.primaries]
    # Two nodes outside the cluster, one made a node of another (one-node) cluster: started first, as
    # such a node takes writes only ~2 s after it starts, a wait the cases before it cover.
    full, bare = cluster.spare_node(), cluster.spare_node(search=False)
    with full.client() as c:
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    _one_line(_run("move-slots", "--url", redis_url, "--to", "127.0.0.1:2", "--slots", "1"), 2, "without cluster mode")
    _one_line(_run("move-slots", "--url", url, "--to", "127.0.0.1:2", "--slots", "1"), 2, "not a node of the cluster")
    _one_line(_run("move-slots", "--url", url, "--to", _addr(primary), "--slots", "16384"), 2, "0-16383")
    _one_line(_run("move-slots", "--url", url, "--to", _addr(primary), "--slots", "9-3"), 2, "0-16383")
    _one_line(_run("move-slots", "--url", url, "--to", _addr(primary), "--slots", "x"), 2, "not a slot range")
    _one_line(_run("move-slots", "--url", url, "--to", _addr(replica), "--slots", "1"), 2, "is a replica")
    _one_line(_run("move-slots", "--url", url, "--to", _addr(primary), "--from", _addr(cluster.primary_nodes[1]),
                   "--slots", "11000"), 2, "not by --from")  # served by the third primary
    _one_line(_run("add-shard", "--url", url, "--node", "127.0.0.1:1"), 1, "127.0.0.1:1 does not answer")
    with full.client() as c:  # holding a key
        for _ in range(100):
            try:
                c.set("left-over", "1")
                break
            except redis.exceptions.ClusterDownError:
                time.sleep(0.05)
    _one_line(_run("add-shard", "--url", url, "--node", _addr(full)), 2, "is not empty")
    _one_line(_run("add-shard", "--url", url, "--node", _addr(bare)), 2, "no query engine")
    for node in (full, bare):
        cluster.kill(node)
    p0, p1, p2 = cluster.primary_nodes
    slot = 100  # the first primary's, left open towards the second by some other move
    with p0.client() as a, p1.client() as b:
        b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", a.execute_command("CLUSTER", "MYID"))
        a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", b.execute_command("CLUSTER", "MYID"))
        try:
            _one_line(_run("move-slots", "--url", url, "--to", _addr(p2), "--slots", str(slot)), 2,
                      "slot 100 is", "CLUSTER SETSLOT 100 STABLE")
        finally:
            for c in (a, b):
                c.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")


async def test_clients_follow_ask_to_a_shard_they_have_not_met(cluster: EmbeddedCluster) -> None:
    """Clients made before a shard joined meet it first through the ``ASK`` of a slot moving to it
    (``shared.stores.connect``): both the asyncio and the blocking client read the moved key."""
    key = "{asker}:k"
    with sync_client(cluster.url) as r:
        r.set(key, "v")
    aclient, sclient = async_client(cluster.url), sync_client(cluster.url)
    try:
        assert await aclient.get(key) == b"v" and sclient.get(key) == b"v"
        spare = cluster.spare_node()
        admin = connect(cluster.url)
        try:
            target = join(admin, _addr(spare))
            source = cluster.node_for_key(key)
            with spare.client() as t, source.client() as s:
                t.execute_command("CLUSTER", "SETSLOT", key_slot(key), "IMPORTING", admin.find(_addr(source)).node_id)
                s.execute_command("CLUSTER", "SETSLOT", key_slot(key), "MIGRATING", target.node_id)
                s.execute_command("MIGRATE", "127.0.0.1", spare.port, "", 0, 5000, "KEYS", key)
            assert await aclient.get(key) == b"v"  # ASK to the new node
            assert sclient.get(key) == b"v"
            move_slots(admin, [key_slot(key)], target, progress=lambda _: None)
        finally:
            admin.close()
        assert await aclient.get(key) == b"v" and sclient.get(key) == b"v"  # MOVED: the map read again
    finally:
        await aclient.aclose()
        sclient.close()
