"""The directive branch's Redis GET (MGET with a stored summary) on keep-alive asyncio connections,
RESP parsed by hiredis.

Why not redis-py for this one call: its per-call Python (pool checkout with a pid check, retry
wrapper, command packing, response parsing layers) costs twice the CPU per call of this one
(``python -m bench.memclient``, docs/performance.md). Everything else (pings, calibration, admin
tools) stays on redis-py.

``redis://`` and ``unix://`` URLs, with their username, password and db, are served, and
``redis+cluster://`` (a Redis Cluster, ``shared.stores.connect``): each call goes to the primary
serving its first key's slot (CRC16, redis-py's ``key_slot``), a ``MOVED`` reply or a failed
node refreshes the slot map (``CLUSTER SLOTS``) and the call is sent again, an ``ASK`` reply sends
it to the node named with ``ASKING`` first. ``Connection.for_url`` returns None for any other
URL (``rediss://``), and the caller keeps redis-py.
A failed or closed connection is a ``ConnectionError``; an error reply (e.g. WRONGTYPE) is
``ReplyError`` carrying Redis's message. A call cancelled mid-way (the branch's deadline) closes
its connection, so a late reply can never be read as another call's. Timeouts are the caller's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from ..shared.stores.connect import is_cluster_url, key_slot, node_url
from .exchange import Exchange


def _pack(*args: str) -> bytes:
    return hiredis.pack_command(args)  # type: ignore[arg-type,no-any-return]  # its stub: a 1-tuple


class ReplyError(Exception):
    """Redis answered with an error (its message is the exception's)."""


class _Conn(Exchange[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.reader = hiredis.Reader()

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
            reply = self.reader.gets()
        except hiredis.ProtocolError as exc:
            self._fail(ConnectionError(f"not a Redis reply: {exc}"))
            return
        if reply is False:
            return
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():  # nobody asked: the connection cannot be trusted
            self.close()
            return
        waiter.set_result(reply)

    def call(self, command: bytes) -> asyncio.Future[Any]:
        return self._ask(command)


class Connection:
    """A small pool of connections to one Redis, for GET."""

    def __init__(self, *, host: str, port: int, path: str | None, db: int, username: str | None,
                 password: str | None, max_idle: int) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.auth = None if password is None else (
            ("AUTH", password) if username is None else ("AUTH", username, password))
        self.max_idle = max_idle
        self.idle: list[_Conn] = []

    @classmethod
    def for_url(cls, url: str, *, max_idle: int) -> Connection | None:
        if is_cluster_url(url):
            node = Connection.for_url(node_url(url), max_idle=max_idle)
            return None if node is None else ClusterConnection(node)
        kw = parse_url(url)
        kind = kw.get("connection_class")
        if kind is SSLConnection or (kind is not None and kind is not UnixDomainSocketConnection):
            return None
        return cls(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)),
                   path=kw.get("path"), db=int(kw.get("db", 0)), username=kw.get("username"),
                   password=kw.get("password"), max_idle=max_idle)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            if self.path is not None:
                _, conn = await loop.create_unix_connection(_Conn, self.path)
            else:
                _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to Redis: {exc}") from exc
        try:
            for command in ([self.auth] if self.auth else []) + ([("SELECT", str(self.db))] if self.db else []):
                reply = await conn.call(_pack(*command))
                if isinstance(reply, hiredis.ReplyError):
                    raise ConnectionError(f"Redis refused {command[0]}: {reply}")
        except BaseException:
            conn.close()
            raise
        return conn

    async def _call(self, *command: str, asking: bool = False) -> Any:
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn.closed:
                conn = None
        if conn is None:
            conn = await self._connect()
        try:
            if asking:  # a slot on the move: this node serves the key for this one command
                await conn.call(_pack("ASKING"))
            reply = await conn.call(_pack(*command))
        except BaseException:  # cancelled (deadline) or failed: never reuse it
            conn.close()
            raise
        if not conn.closed and len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.close()
        if isinstance(reply, hiredis.ReplyError):
            raise ReplyError(str(reply))
        return reply

    async def get(self, key: str) -> bytes | None:
        reply = await self._call("GET", key)
        if reply is not None and not isinstance(reply, bytes):
            raise ReplyError(f"GET answered a {type(reply).__name__}")
        return reply

    async def mget(self, *keys: str) -> list[bytes | None]:
        """Several keys in one round trip (MGET: a key holding another type reads as absent)."""
        reply = await self._call("MGET", *keys)
        if not isinstance(reply, list) or len(reply) != len(keys) \
                or not all(v is None or isinstance(v, bytes) for v in reply):
            raise ReplyError(f"MGET answered a {type(reply).__name__}")
        return reply

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


_ROUTE_ATTEMPTS = 3  # a failover or a slot move: the map is read again between attempts


class ClusterConnection(Connection):
    """The same calls on a Redis Cluster: one small pool per primary, routed by slot."""

    def __init__(self, seed: Connection) -> None:
        super().__init__(host=seed.host, port=seed.port, path=None, db=0, username=None, password=None,
                         max_idle=seed.max_idle)
        self.auth = seed.auth
        self.seeds: list[tuple[str, int]] = [(seed.host, seed.port)]
        self.nodes: dict[tuple[str, int], Connection] = {}
        self.slots: list[tuple[int, int, tuple[str, int]]] = []

    def _node(self, addr: tuple[str, int]) -> Connection:
        node = self.nodes.get(addr)
        if node is None:
            node = self.nodes[addr] = Connection(host=addr[0], port=addr[1], path=None, db=0, username=None,
                                                 password=None, max_idle=self.max_idle)
            node.auth = self.auth
        return node

    async def refresh(self) -> None:
        """Read the slot map from the first node that answers (the known primaries, then the seed)."""
        last: Exception = ConnectionError("no cluster node to ask for the slot map")
        for addr in [*dict.fromkeys([a for _, _, a in self.slots] + self.seeds)]:
            try:
                reply = await self._node(addr)._call("CLUSTER", "SLOTS")
            except (ConnectionError, ReplyError) as exc:
                last = exc
                continue
            self.slots = [(int(r[0]), int(r[1]), (_text(r[2][0]) or addr[0], int(r[2][1]))) for r in reply]
            self.seeds = [*dict.fromkeys(self.seeds + [a for _, _, a in self.slots])]
            return
        raise last if isinstance(last, ConnectionError) else ConnectionError(str(last))

    async def _primary(self, slot: int) -> Connection:
        if not self.slots:
            await self.refresh()
        for lo, hi, addr in self.slots:
            if lo <= slot <= hi:
                return self._node(addr)
        raise ConnectionError(f"no cluster node serves slot {slot}")

    async def _call(self, *command: str, asking: bool = False) -> Any:
        slot = key_slot(command[1])
        for attempt in range(_ROUTE_ATTEMPTS):
            last = attempt == _ROUTE_ATTEMPTS - 1
            node = await self._primary(slot)
            try:
                return await node._call(*command)
            except ReplyError as exc:
                kind, _, rest = str(exc).partition(" ")
                if kind == "ASK":
                    return await self._node(_addr(rest))._call(*command, asking=True)
                if kind not in ("MOVED", "CLUSTERDOWN") or last:
                    raise
            except ConnectionError:
                if last:
                    raise
            self.slots = []  # MOVED, or the node is gone: read the map again
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _addr(moved: str) -> tuple[str, int]:
    """``host:port`` of a ``MOVED``/``ASK`` reply's tail (``<slot> <host>:<port>``)."""
    host, _, port = moved.split(" ")[-1].rpartition(":")
    return host, int(port)
