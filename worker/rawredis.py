"""The directive branch's Redis GET (MGET with a stored summary) on keep-alive asyncio connections,
RESP parsed by hiredis.

Why not redis-py for this one call: its per-call Python (pool checkout with a pid check, retry
wrapper, command packing, response parsing layers) costs twice the CPU per call of this one
(``python -m bench.memclient``, docs/performance.md). Everything else (pings, calibration, admin
tools) stays on redis-py.

``redis://`` and ``unix://`` URLs, with their username, password and db, are served;
``Connection.for_url`` returns None for any other (``rediss://``), and the caller keeps redis-py.
A failed or closed connection is a ``ConnectionError``; an error reply (e.g. WRONGTYPE) is
``ReplyError`` carrying Redis's message. A call cancelled mid-way (the branch's deadline) closes
its connection, so a late reply can never be read as another call's. Timeouts are the caller's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from ibex_context.worker.exchange import Exchange


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

    async def _call(self, *command: str) -> Any:
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn.closed:
                conn = None
        if conn is None:
            conn = await self._connect()
        try:
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
