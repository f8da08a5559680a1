"""Moving hash slots of a Redis Cluster to another primary with the memory indexes in place before
any key moves: what ``ibex-context cluster add-shard`` and ``cluster move-slots`` run
(docs/memory-search.md "Shards").

Why the indexes first: the query engine bundled with the product has no coordinator, so an agent's
index (``ibex:mem:EMBEDDER:{ORG:AGENT}``) lives on the shard of its slot and indexes only that
shard's keys. A key that arrives on a shard without its index is stored but never found, and a
search sent on by ``ASK`` while the slot moves would meet "no such index". Redis's own resharding
knows nothing of indexes, so every slot moves in five steps:

1. ``CLUSTER SETSLOT S IMPORTING <source>`` on the target;
2. every memory index of the slot (the source's ``FT._LIST`` read when the move starts) created on
   the target: ``ASKING`` + ``FT.CREATE`` with the product's schema (``memory.search.index.create_args``);
3. ``CLUSTER SETSLOT S MIGRATING <target>`` on the source;
4. batches of ``CLUSTER GETKEYSINSLOT`` + ``MIGRATE ... KEYS``; before a batch moves, an agent in it
   that has no index on the target yet (its first memory came after the listing, or it had none)
   gets one per embedder in use;
5. ``CLUSTER SETSLOT S NODE <target>`` on the target, the source, then every other primary.

Consecutive slots of one source move as a group (``GROUP``): each step goes to its node as one
pipeline for the whole group, so a slot without keys (most of them) costs no round trips of its own.

Resuming: each step is read back from the cluster, so the same command run again after an
interruption continues where it stopped. A slot the target already owns is skipped; a slot left
open towards the same target is finished (an index that exists is kept; keys already moved are no
longer on the source; a key a timed-out ``MIGRATE`` left on both sides is sent again with
``REPLACE``, since the source's copy is the one callers were served). A slot left open towards
another node is refused, as is any careless input, with one line (``ReshardError`` and its kinds).
"""

from __future__ import annotations

import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from ..memory.search.index import create_args
from ..shared.stores.connect import key_slot
from ..shared.stores.keys import memory_index

SLOTS = 16384
GROUP = 64  # slots whose steps go to a node as one pipeline (``SlotMover.move_group``)
MEET_TIMEOUT_S = 30.0  # a bound on gossip spreading a new node, not a speed claim
_INDEX = re.compile(r"^ibex:mem:([^:{}]+):\{([^:{}]+):([^:{}]+)\}$")
_AGENT_KEY = re.compile(r"^(?:mem|memids|hot):\{([^:{}]+):([^:{}]+)\}")
_HEX_ID = re.compile(r"^[0-9a-f]{40}$")


class ReshardError(Exception):
    """Root of the resharding errors; each is one line for the operator.

        ReshardError             a move failed part way (rerun the same command to continue)
        ├── Unreachable          a node or the cluster does not answer
        ├── NotACluster          the URL or node is one server, not a cluster node
        ├── UnknownNode          no such node in the cluster, or a replica where a primary is needed
        ├── BadSlots             a slot range that is not 0-16383, or slots not on --from
        ├── NodeNotEmpty         a new shard that already holds keys or belongs to another cluster
        ├── NoQueryEngine        a node without the query engine (no ``search`` module)
        ├── SlotBusy             a slot already being moved between two other nodes
        └── ForeignIndex         an index in a moving slot that is not a memory index
    """

    usage = False  # True: the input was wrong (exit 2); False: the cluster failed (exit 1)


class Unreachable(ReshardError):
    """A node or the cluster does not answer."""


class _UsageError(ReshardError):
    usage = True


class NotACluster(_UsageError):
    """The URL or node is a server without cluster mode."""


class UnknownNode(_UsageError):
    """No such node, or a replica where a primary is needed."""


class BadSlots(_UsageError):
    """A slot range that is not within 0-16383, or slots not served by ``--from``."""


class NodeNotEmpty(_UsageError):
    """A new shard that holds keys or already belongs to another cluster."""


class NoQueryEngine(_UsageError):
    """A node without the query engine: the moved memories could not be indexed there."""


class SlotBusy(_UsageError):
    """A slot already open (migrating or importing) between other nodes."""


class ForeignIndex(_UsageError):
    """An index in a moving slot whose schema this command does not know."""


@dataclass(frozen=True)
class Access:
    """How to reach any node of the cluster: the URL's credentials and TLS, on another host:port."""

    username: str | None = None
    password: str | None = None
    ssl: bool = False
    timeout_s: float = 10.0

    def client(self, host: str, port: int, *, single: bool = False) -> redis.Redis:
        """A client of one node; ``single``: one connection (``ASKING`` holds for its next command)."""
        return redis.Redis(host=host, port=port, username=self.username, password=self.password, ssl=self.ssl,
                           socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                           decode_responses=True, single_connection_client=single)

    def migrate_auth(self) -> list[str]:
        """``MIGRATE``'s credentials for the target (the same as ours)."""
        if self.password is None:
            return []
        return ["AUTH2", self.username, self.password] if self.username else ["AUTH", self.password]


def parse_url(url: str, *, timeout_s: float = 10.0) -> tuple[Access, str, int]:
    """``redis[s][+cluster]://[user:pass@]host:port`` as credentials and the node it names."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise NotACluster(f"{url!r} names no cluster node (expected redis+cluster://HOST:PORT)")
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise NotACluster(f"{url!r}: {exc}") from None
    access = Access(username=unquote(parts.username) if parts.username else None,
                    password=unquote(parts.password) if parts.password else None,
                    ssl=parts.scheme.startswith("rediss"), timeout_s=timeout_s)
    return access, parts.hostname or "127.0.0.1", port


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a node (``UnknownNode`` when it is not one)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UnknownNode(f"{text!r} is not HOST:PORT")
    return host, int(port)


def parse_slots(text: str) -> list[int]:
    """``A-B[,C[-D]...]`` as sorted distinct slots (``BadSlots`` for anything outside 0-16383)."""
    slots: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise BadSlots(f"{text!r} is not a slot range like 0-99 or 5,7-9")
        a, b = int(lo), int(hi) if sep else int(lo)
        if not 0 <= a <= b < SLOTS:
            raise BadSlots(f"slot range {part.strip()!r} is not within 0-{SLOTS - 1} (low end first)")
        slots.update(range(a, b + 1))
    return sorted(slots)


@dataclass
class Node:
    """One node as ``CLUSTER NODES`` lists it."""

    node_id: str
    host: str
    port: int
    primary: bool
    failed: bool
    slots: set[int] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_nodes(text: str) -> list[Node]:
    """The nodes of a ``CLUSTER NODES`` reply (open-slot markers ``[S->-id]`` are skipped)."""
    nodes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        addr = parts[1].split("@")[0]
        host, _, port = addr.rpartition(":")
        flags = parts[2].split(",")
        node = Node(parts[0], host, int(port or 0), "master" in flags,
                    any(f in flags for f in ("fail", "noaddr", "handshake")))
        for rng in parts[8:]:
            if rng.startswith("["):
                continue
            lo, _, hi = rng.partition("-")
            node.slots.update(range(int(lo), int(hi or lo) + 1))
        nodes.append(node)
    return nodes


def open_slots(client: redis.Redis) -> dict[int, tuple[str, str]]:
    """This node's open slots: slot -> ("migrating" | "importing", the other node's id)."""
    found: dict[int, tuple[str, str]] = {}
    for line in str(_cmd(client, "CLUSTER", "NODES")).splitlines():
        parts = line.split()
        if len(parts) < 3 or "myself" not in parts[2]:
            continue
        for mark in parts[8:]:
            m = re.fullmatch(r"\[(\d+)-([<>])-([0-9a-f]+)\]", mark)
            if m:
                found[int(m.group(1))] = ("migrating" if m.group(2) == ">" else "importing", m.group(3))
    return found


def _cmd(client: redis.Redis, *args: Any) -> Any:
    """One raw command (redis-py leaves ``execute_command`` untyped)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _each(client: redis.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Raw commands to one node as one pipeline (no transaction), their answers in order; the
    first error raised."""
    pipe = client.pipeline(transaction=False)
    for args in commands:
        pipe.execute_command(*args)  # type: ignore[no-untyped-call]
    return list(pipe.execute())


def _ranges(slots: list[int]) -> str:
    """``5-9`` for slots 5 to 9, ``5`` for one."""
    return f"{slots[0]}-{slots[-1]}" if len(slots) > 1 else str(slots[0])


def _call(what: str, fn: Callable[[], Any]) -> Any:
    """Run one Redis call, a connection failure as ``Unreachable`` naming ``what``."""
    try:
        return fn()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise Unreachable(f"{what} does not answer: {exc}") from None


@dataclass
class Cluster:
    """The cluster as one node sees it, with a client per node."""

    access: Access
    entry: str
    nodes: list[Node]
    _clients: dict[str, redis.Redis] = field(default_factory=dict)

    def client(self, node: Node) -> redis.Redis:
        if node.node_id not in self._clients:
            self._clients[node.node_id] = self.access.client(node.host, node.port)
        return self._clients[node.node_id]

    @property
    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.primary and not n.failed]

    def owner(self, slot: int) -> Node | None:
        return next((n for n in self.primaries if slot in n.slots), None)

    def find(self, spec: str) -> Node:
        """A node by ``HOST:PORT`` (the host as named or resolved) or by its 40-hex id."""
        if _HEX_ID.fullmatch(spec):
            found = [n for n in self.nodes if n.node_id == spec]
        else:
            host, port = parse_address(spec)
            hosts = {host, _resolve(host)}
            found = [n for n in self.nodes if n.port == port and (n.host in hosts or _resolve(n.host) in hosts)]
        if not found:
            raise UnknownNode(f"{spec} is not a node of the cluster at {self.entry}")
        return found[0]

    def refresh(self) -> None:
        entry = next(iter(self._clients.values()), None) or self.client(self.primaries[0])
        self.nodes = parse_nodes(str(_call(self.entry, lambda: _cmd(entry, "CLUSTER", "NODES"))))

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def connect(url: str, *, timeout_s: float = 10.0) -> Cluster:
    """The cluster ``url`` names by one node (``Unreachable``, ``NotACluster``)."""
    access, host, port = parse_url(url, timeout_s=timeout_s)
    entry = access.client(host, port)
    try:
        info = _call(f"the cluster at {host}:{port}", lambda: entry.info("cluster"))
        if not int(info.get("cluster_enabled", 0)):
            raise NotACluster(f"{host}:{port} is a Redis server without cluster mode, not a cluster node")
        nodes = parse_nodes(str(_cmd(entry, "CLUSTER", "NODES")))
    except redis.AuthenticationError as exc:
        raise Unreachable(f"{host}:{port} refused the URL's credentials: {exc}") from None
    finally:
        entry.close()
    return Cluster(access=access, entry=f"{host}:{port}", nodes=nodes)


def check_query_engine(client: redis.Redis, where: str) -> None:
    """``NoQueryEngine`` unless the node has loaded the ``search`` module."""
    modules = _call(where, lambda: _cmd(client, "MODULE", "LIST"))
    names = {str(m.get("name") if isinstance(m, dict) else dict(zip(m[::2], m[1::2], strict=False)).get("name"))
             for m in modules or []}
    if "search" not in names:
        raise NoQueryEngine(f"{where} has no query engine (no search module): the memories moved there "
                            "could not be searched")


def memory_index_of(name: str) -> tuple[str, str, str] | None:
    """(embedder, org, agent) of a per-agent memory index name, else None."""
    m = _INDEX.fullmatch(name)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def agent_of_key(key: str) -> tuple[str, str] | None:
    """(org, agent) of one of an agent's memory keys (``mem:``, ``memids:``, ``hot:``), else None."""
    m = _AGENT_KEY.match(key)
    return (m.group(1), m.group(2)) if m else None


def info_fields(info: Any) -> dict[Any, Any]:
    """An ``FT.INFO`` reply as a map, whether it came as one (RESP3) or as a flat list (RESP2)."""
    return info if isinstance(info, dict) else dict(zip(info[::2], info[1::2], strict=False))


def vector_dim(info: Any) -> int | None:
    """The vector field's dimension in an ``FT.INFO`` reply (map or flat list), if any."""
    info_map = info_fields(info)
    for attr in info_map.get("attributes", []):
        a = attr if isinstance(attr, dict) else dict(zip(attr[::2], attr[1::2], strict=False))
        if str(a.get("type")) == "VECTOR" and a.get("dim") is not None:
            return int(a["dim"])
    return None


def still_indexing(info: Any) -> bool:
    """Whether an ``FT.INFO`` reply (map or flat list) says the index still scans existing keys:
    an index created over keys already there finds them in the background."""
    info_map = info_fields(info)
    return str(info_map.get("indexing", 0)) not in ("0", "0.0")


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = MEET_TIMEOUT_S) -> None:
    """Poll ``check`` until true; ``ReshardError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            raise ReshardError(f"{what} within {timeout_s:.0f}s; rerun the same command to continue")
        time.sleep(0.05)


def index_create_args(name: str, dim: int) -> list[str]:
    """The ``FT.CREATE`` arguments of the memory index ``name`` (the product's schema)."""
    parsed = memory_index_of(name)
    if parsed is None:
        raise ForeignIndex(f"index {name!r} is not a memory index")
    embedder, org, agent = parsed
    return create_args(embedder, dim, org, agent, per_agent=True)


@dataclass
class MoveReport:
    """What one run did (the summary line)."""

    target: str
    slots_moved: int = 0
    slots_already: int = 0
    keys: int = 0
    indexes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        already = f" ({self.slots_already} already there)" if self.slots_already else ""
        return (f"moved {self.slots_moved} slots{already} with {self.keys} keys to {self.target}; "
                f"created {self.indexes} memory indexes there first; {self.seconds:.1f}s")


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class SlotMover:
    """Moves slots to ``target`` a group at a time (``move_group``), each slot's memory indexes created there first."""

    cluster: Cluster
    target: Node
    batch: int = 100
    migrate_timeout_ms: int = 10_000
    _indexes: dict[int, list[str]] = field(default_factory=dict)  # slot -> index names on its owner
    _agents: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # agent -> its index names
    _embedders: dict[str, list[tuple[Node, str]]] = field(default_factory=dict)  # embedder -> (owner, index)
    _dims: dict[str, int] = field(default_factory=dict)
    _ensured: set[str] = field(default_factory=set)
    _created: list[str] = field(default_factory=list)  # created on the target during this slot's move
    _asking: redis.Redis | None = None

    def prepare(self, slots: list[int]) -> None:
        """Read each source's memory indexes (``FT._LIST``); ``ForeignIndex`` for any other index
        in a moving slot."""
        moving = set(slots)
        for source in {id(n): n for s in slots if (n := self.cluster.owner(s)) is not None}.values():
            client = self.cluster.client(source)
            for name in map(str, _call(source.address, partial(_cmd, client, "FT._LIST"))):
                slot = key_slot(name)
                if slot not in source.slots:
                    continue  # a definition left behind by an earlier move: its keys are elsewhere
                parsed = memory_index_of(name)
                if parsed is None:
                    if slot in moving:
                        raise ForeignIndex(f"index {name!r} in slot {slot} on {source.address} is not a memory "
                                           "index: create it on the target by hand, or leave that slot")
                    continue
                self._embedders.setdefault(parsed[0], []).append((source, name))
                if slot in moving:
                    self._indexes.setdefault(slot, []).append(name)
                    self._agents.setdefault((parsed[1], parsed[2]), []).append(name)

    def _dim(self, embedder: str) -> int:
        """The vector size of the embedder's indexes, read from one of them (``FT.INFO``)."""
        if embedder not in self._dims:
            for owner, name in self._embedders.get(embedder, []):
                try:
                    dim = vector_dim(_cmd(self.cluster.client(owner), "FT.INFO", name))
                except redis.ResponseError:  # its slot is open: the owner answers ASK; the target may have it
                    try:
                        dim = vector_dim(self._ask("FT.INFO", name))
                    except redis.ResponseError:
                        continue
                if dim is not None:
                    self._dims[embedder] = dim
                    break
            else:
                raise ReshardError(f"no index of embedder {embedder} tells its vector size; "
                                   "rerun the same command once the open slots are finished")
        return self._dims[embedder]

    def _ask(self, *args: Any) -> Any:
        if self._asking is None:
            self._asking = self.cluster.access.client(self.target.host, self.target.port, single=True)
        _cmd(self._asking, "ASKING")
        return _cmd(self._asking, *args)

    def ensure(self, name: str) -> int:
        """Create the memory index ``name`` on the target unless it is there; 1 when created."""
        if name in self._ensured:
            return 0
        created = 0
        try:
            self._ask("FT.INFO", name)
        except redis.ResponseError as exc:
            if "unknown index" not in str(exc).lower() and "no such index" not in str(exc).lower():
                raise
            embedder = memory_index_of(name)
            try:
                self._ask("FT.CREATE", *index_create_args(name, self._dim(embedder[0] if embedder else "")))
                self._created.append(name)
                created = 1
            except redis.ResponseError as again:
                if "already exists" not in str(again).lower():
                    raise
        self._ensured.add(name)
        return created

    def _ensure_agents(self, keys: list[str]) -> int:
        """Indexes for the agents of ``keys`` not created yet: the ones listed at the start, or for
        an agent newer than the listing, one per embedder in use."""
        created = 0
        for agent in {a for k in keys if (a := agent_of_key(k)) is not None}:
            try:
                names = self._agents.get(agent) or [memory_index(e, *agent, per_agent=True)[0] for e in self._embedders]
            except ValueError:  # not identifiers the product writes: no index of ours
                continue
            created += sum(self.ensure(n) for n in names)
        return created

    def _migrate(self, slot: int, source: Node, keys: list[str]) -> None:
        client = self.cluster.client(source)
        head = [self.target.host, self.target.port, "", 0, self.migrate_timeout_ms]
        auth = self.cluster.access.migrate_auth()
        try:
            _cmd(client, "MIGRATE", *head, *auth, "KEYS", *keys)
        except redis.ResponseError as exc:
            if "BUSYKEY" not in str(exc):
                raise
            # A MIGRATE cut short left a copy on the target; the source's copy is current.
            _cmd(client, "MIGRATE", *head, "REPLACE", *auth, "KEYS", *keys)

    def move(self, slot: int) -> tuple[int, int]:
        """Move one slot (or finish its open move); (keys moved, indexes created)."""
        return self.move_group([slot])

    def move_group(self, slots: list[int]) -> tuple[int, int]:
        """Move slots of one source (or finish their open moves), each step of every slot sent to
        a node as one pipeline: a slot without keys costs no round trip of its own. (keys moved,
        indexes created)."""
        source = self.cluster.owner(slots[0])
        if source is None:
            raise ReshardError(f"no primary serves slot {slots[0]}: fix the cluster first")
        if any(self.cluster.owner(s) is not source for s in slots):
            raise ValueError("move_group: slots of one source only")
        src, tgt = self.cluster.client(source), self.cluster.client(self.target)
        _each(tgt, [("CLUSTER", "SETSLOT", s, "IMPORTING", source.node_id) for s in slots])
        created = sum(self.ensure(n) for s in slots for n in self._indexes.get(s, []))
        _each(src, [("CLUSTER", "SETSLOT", s, "MIGRATING", self.target.node_id) for s in slots])
        moved = 0
        first = _each(src, [("CLUSTER", "GETKEYSINSLOT", s, self.batch) for s in slots])
        for slot, found in zip(slots, first, strict=True):
            keys = [str(k) for k in found]
            while keys:
                created += self._ensure_agents(keys)
                self._migrate(slot, source, keys)
                moved += len(keys)
                keys = [str(k) for k in _cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, self.batch)]
        self._built(slots)
        self._assign(slots, source)
        return moved, created

    def _built(self, slots: list[int]) -> None:
        """Wait until the indexes created for ``slots`` have indexed the keys that reached the target
        before them (a move resumed after an interruption): the slots are handed over complete."""
        names, self._created = self._created, []
        for name in names:
            wait_until(partial(self._indexed, name),
                       f"index {name} on {self.target.address} did not finish indexing the keys of slot "
                       f"{key_slot(name)}")

    def _indexed(self, name: str) -> bool:
        return not still_indexing(self._ask("FT.INFO", name))

    def _assign(self, slots: list[int], source: Node) -> None:
        """``SETSLOT NODE`` on the target, the source, then the other primaries (gossip would tell
        them too; telling them now spares callers a ``MOVED`` round)."""
        others = [n for n in self.cluster.primaries if n not in (self.target, source)]
        for node in [self.target, source, *others]:
            try:
                _each(self.cluster.client(node), [("CLUSTER", "SETSLOT", s, "NODE", self.target.node_id)
                                                  for s in slots])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if node in (self.target, source):
                    raise
                _stderr(f"warning: {node.address} did not take the new owner of slots {_ranges(slots)} ({exc}); "
                        "gossip will tell it")
        source.slots.difference_update(slots)
        self.target.slots.update(slots)

    def close(self) -> None:
        if self._asking is not None:
            self._asking.close()


def _check_open(cluster: Cluster, slots: list[int], target: Node) -> None:
    """``SlotBusy`` when a moving slot is open in a direction other than its owner -> ``target``."""
    wanted = set(slots)
    for node in cluster.primaries:
        for slot, (state, other) in open_slots(cluster.client(node)).items():
            if slot not in wanted:
                continue
            owner = cluster.owner(slot)
            ours = (state == "migrating" and node is owner and other == target.node_id) or \
                   (state == "importing" and node is target and owner is not None and other == owner.node_id)
            if not ours:
                raise SlotBusy(f"slot {slot} is {state} on {node.address} (with node {other[:8]}): "
                               f"finish or cancel that move first (CLUSTER SETSLOT {slot} STABLE)")


def _check_ok(cluster: Cluster) -> None:
    for node in cluster.primaries:
        client = cluster.client(node)
        info = str(_call(node.address, partial(_cmd, client, "CLUSTER", "INFO")))
        if "cluster_state:ok" not in info:
            raise ReshardError(f"the cluster is not ok on {node.address} (cluster_state:fail): fix it first")


def _groups(cluster: Cluster, slots: list[int]) -> list[list[int]]:
    """``slots`` (sorted) cut into runs of consecutive slots of one owner, at most ``GROUP`` each."""
    out: list[list[int]] = []
    for slot in slots:
        last = out[-1] if out else None
        if (last is not None and len(last) < GROUP and slot == last[-1] + 1
                and cluster.owner(slot) is cluster.owner(last[0])):
            last.append(slot)
        else:
            out.append([slot])
    return out


def move_slots(cluster: Cluster, slots: list[int], target: Node, *, source: Node | None = None,
               batch: int = 100, migrate_timeout_ms: int = 10_000, progress: Progress = _stderr) -> MoveReport:
    """Move ``slots`` to the primary ``target``, each with its memory indexes created there first.

    ``source``: every slot must be served by it (``BadSlots`` otherwise). Progress goes to
    ``progress`` about once a second; the report says what moved. Safe to run again after an
    interruption (the module's docstring says how)."""
    if not target.primary:
        raise UnknownNode(f"{target.address} is a replica: slots move to a primary")
    for slot in slots:
        owner = cluster.owner(slot)
        if source is not None and owner is not source and owner is not target:
            raise BadSlots(f"slot {slot} is served by {owner.address if owner else 'no node'}, "
                           f"not by --from {source.address}")
    check_query_engine(cluster.client(target), target.address)
    _check_ok(cluster)
    _check_open(cluster, slots, target)
    report = MoveReport(target=target.address)
    todo = [s for s in slots if cluster.owner(s) is not target]
    report.slots_already = len(slots) - len(todo)
    mover = SlotMover(cluster, target, batch=batch, migrate_timeout_ms=migrate_timeout_ms)
    start = last = time.monotonic()
    try:
        mover.prepare(todo)
        i = 0
        for group in _groups(cluster, todo):
            try:
                keys, created = mover.move_group(group)
            except redis.RedisError as exc:
                raise ReshardError(f"slot {_ranges(group)} to {target.address}: {exc}; rerun the same command to "
                                   "continue") from None
            i += len(group)
            report.slots_moved, report.keys, report.indexes = i, report.keys + keys, report.indexes + created
            if time.monotonic() - last >= 1.0 or i == len(todo):
                last = time.monotonic()
                progress(f"{i}/{len(todo)} slots ({group[-1]} last), {report.keys} keys, "
                         f"{report.indexes} indexes created, {last - start:.1f}s")
    finally:
        mover.close()
    report.seconds = time.monotonic() - start
    return report


def share_plan(cluster: Cluster, target: Node, count: int | None) -> list[int]:
    """The slots that give ``target`` ``count`` slots (default: an even share), taken from the
    primaries holding the most, from the top of each one's slots."""
    donors = sorted((p for p in cluster.primaries if p is not target and p.slots), key=lambda p: p.port)
    want = count if count is not None else SLOTS // (len(donors) + 1)
    if not 0 <= want <= SLOTS - len(donors):
        raise BadSlots(f"--slot-count {want} is not within 0-{SLOTS - len(donors)} "
                       "(every other primary keeps at least one slot)")
    give = {d.node_id: 0 for d in donors}
    for _ in range(max(0, want - len(target.slots))):
        d = max(donors, key=lambda n: len(n.slots) - give[n.node_id])
        give[d.node_id] += 1
    return sorted(s for d in donors for s in sorted(d.slots)[len(d.slots) - give[d.node_id]:])


def _open_towards(cluster: Cluster, target: Node) -> set[int]:
    """Slots a primary is migrating to ``target`` (an interrupted run's)."""
    return {slot for node in cluster.primaries if node is not target
            for slot, (state, other) in open_slots(cluster.client(node)).items()
            if state == "migrating" and other == target.node_id}


def join(cluster: Cluster, spec: str) -> Node:
    """The node ``HOST:PORT`` as a member of the cluster: an empty, cluster-enabled node with the
    query engine is introduced (``CLUSTER MEET``) and known by every primary on return; a member
    is returned as it is (a resumed run)."""
    host, port = parse_address(spec)
    client = cluster.access.client(host, port)
    try:
        info = _call(spec, lambda: client.info("cluster"))
        if not int(info.get("cluster_enabled", 0)):
            raise NotACluster(f"{spec} runs without cluster mode (start it with --cluster-enabled yes)")
        check_query_engine(client, spec)
        node_id = str(_cmd(client, "CLUSTER", "MYID"))
        if any(n.node_id == node_id for n in cluster.nodes):
            return cluster.find(node_id)
        state = str(_cmd(client, "CLUSTER", "INFO"))
        if client.dbsize() or not re.search(r"^cluster_known_nodes:1\s*$", state, re.MULTILINE):
            raise NodeNotEmpty(f"{spec} is not empty (it holds keys or knows other nodes): a new shard starts "
                               "empty, outside any cluster")
        first = cluster.primaries[0]
        _cmd(cluster.client(first), "CLUSTER", "MEET", _resolve(host), port)
        ids = {p.node_id for p in cluster.primaries}

        def known() -> bool:
            mine = {n.node_id for n in parse_nodes(str(_cmd(client, "CLUSTER", "NODES"))) if not n.failed}
            ok = "cluster_state:ok" in str(_cmd(client, "CLUSTER", "INFO"))
            return ok and ids <= mine and all(
                any(n.node_id == node_id and not n.failed
                    for n in parse_nodes(str(_cmd(cluster.client(p), "CLUSTER", "NODES"))))
                for p in cluster.primaries)

        wait_until(known, f"{spec} did not join the cluster")
    finally:
        client.close()
    cluster.refresh()
    return cluster.find(node_id)


def add_shard(cluster: Cluster, spec: str, *, count: int | None = None, batch: int = 100,
              migrate_timeout_ms: int = 10_000, progress: Progress = _stderr) -> MoveReport:
    """Join the empty node ``HOST:PORT`` to the cluster and move it ``count`` slots (default: an
    even share), indexes first. Run again after an interruption, it finishes the same share."""
    target = join(cluster, spec)
    if not target.primary:
        raise UnknownNode(f"{spec} is a replica in this cluster: a new shard is a primary")
    plan = sorted(set(share_plan(cluster, target, count)) | _open_towards(cluster, target))
    progress(f"{spec} is node {target.node_id[:8]}; moving it {len(plan)} slots")
    return move_slots(cluster, plan, target, batch=batch, migrate_timeout_ms=migrate_timeout_ms, progress=progress)
