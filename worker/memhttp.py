"""The worker's HTTP/1.1 client for the memory service: keep-alive connections on asyncio
protocols, responses parsed by httptools (llhttp, the C parser uvicorn uses).

Why not aiohttp: a served assembly makes two calls, and aiohttp's per-call Python (request and
response objects, header multidicts, timers, stream readers) cost the worker more CPU than the
whole pipeline (docs/performance.md, ``python -m bench.workercpu`` and ``bench.memclient``). The
worker needs one thing: send a small request to one service, read one bounded body.

Contract kept from before: a response over ``max_body`` bytes is refused as soon as it crosses the
limit (``ResponseTooLarge``, the connection dropped); a connection closed before a whole response
is ``ServerDisconnectedError``; a refused or unreachable service is ``ConnectError``. A call
cancelled mid-way (the branch's deadline) keeps its connection out of the pool until the late
answer has been read and dropped (closed after ``LATE_S``), so that answer can never be read as
the next call's, and a slow service does not also pay for new connections. Timeouts are the
caller's (``asyncio.timeout`` around the call).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

import httptools

from .exchange import Exchange

LATE_S = 1.0  # how long a cancelled call's connection waits for its answer before it is closed


class MalformedResponse(Exception):
    """The memory service answered, but not with the contract's HTTP or JSON."""


class ResponseTooLarge(MalformedResponse):
    pass


class ConnectError(ConnectionError):
    """The memory service could not be reached (refused, unreachable, or DNS)."""


class ServerDisconnectedError(ConnectionError):
    """The memory service closed the connection before a whole response."""


class _Conn(Exchange[tuple[int, bytes]]):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, max_body: int) -> None:
        super().__init__()
        self.max_body = max_body
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.size = 0
        self.received = False  # any byte of the current response
        self.on_late: Callable[[_Conn], None] | None = None  # set while a cancelled call's answer is awaited

    # -- asyncio.Protocol
    def _lost(self) -> Exception:
        return ServerDisconnectedError("the memory service closed the connection before a whole response")

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.waiter is None and self.on_late is None:  # bytes nobody asked for: cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(MalformedResponse("the memory service asked to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(MalformedResponse(f"not an HTTP/1.1 response: {exc}"))

    # -- httptools callbacks
    def on_body(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_body:
            self._fail(ResponseTooLarge(f"response exceeds {self.max_body} bytes"))
            return
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        status = self.parser.get_status_code()
        if not self.parser.should_keep_alive():
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result((status, b"".join(self.body)))
        elif self.on_late is not None:  # a cancelled call's answer, read and dropped: reusable again
            on_late, self.on_late = self.on_late, None
            on_late(self)

    # -- use
    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.on_late is None
        self.body, self.size, self.received = [], 0, False
        self.parser = httptools.HttpResponseParser(self)
        return self._ask(request)

    def close(self) -> None:
        self.on_late = None
        super().close()


class MemoryHTTP:
    """A small pool of keep-alive connections to one base URL (``http://`` or ``https://``)."""

    def __init__(self, base_url: str, *, max_body: int, max_idle: int, user_agent: str = "ibex-context-worker") -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"memory service URL must be http:// or https:// with a host, got {base_url!r}")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        netloc = host if parts.port is None else f"{host}:{parts.port}"
        self._fixed = f"Host: {netloc}\r\nUser-Agent: {user_agent}\r\n".encode("latin-1")
        self.max_body = max_body
        self.max_idle = max_idle
        self.idle: list[_Conn] = []
        self.late: set[_Conn] = set()  # connections whose cancelled call's answer is still coming

    def request_bytes(self, method: str, path: str, headers: bytes, *, params: dict[str, str] | None = None,
                      body: bytes | None = None, content_type: str = "application/json") -> bytes:
        """One request's bytes; ``headers`` are complete ``Name: value\\r\\n`` lines."""
        target = self.prefix + path + ("?" + urlencode(params) if params else "")
        head = f"{method} {target} HTTP/1.1\r\n".encode() + self._fixed + headers
        if body is None:
            return head + b"\r\n"
        return head + f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self.max_body), self.host, self.port, ssl=self.ssl)
        except OSError as exc:  # refused, unreachable, DNS (gaierror is an OSError)
            raise ConnectError(f"cannot connect to the memory service at {self.base_url}: {exc}") from exc
        return conn

    async def request(self, request: bytes) -> tuple[int, bytes]:
        """Send one request, return (status, body). A reused connection the service had already
        closed (its keep-alive ended) is retried once on a new one, as nothing was read from it."""
        while self.idle:
            conn = self.idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, request)
            except ServerDisconnectedError:
                if conn.received:
                    raise
                break
        return await self._exchange(await self._connect(), request)

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[int, bytes]:
        try:
            result = await conn.send(request)
        except asyncio.CancelledError:  # the branch's deadline: let the answer finish, then reuse
            self._await_late(conn)
            raise
        except BaseException:  # failed: never reuse a half-read connection
            conn.close()
            raise
        self._release(conn)
        return result

    def _await_late(self, conn: _Conn) -> None:
        """Keep a cancelled call's connection until its answer has been read and dropped (at most
        ``LATE_S``), instead of closing it: a timed-out branch would otherwise cost a new TCP
        connection on both sides, when the service is already slow."""
        if conn.closed or len(self.late) >= self.max_idle:
            conn.close()
            return
        conn.waiter = None
        conn.on_late = self._late_done
        self.late.add(conn)
        asyncio.get_running_loop().call_later(LATE_S, self._late_expired, conn)

    def _late_done(self, conn: _Conn) -> None:
        self.late.discard(conn)
        self._release(conn)

    def _late_expired(self, conn: _Conn) -> None:
        if conn in self.late:
            self.late.discard(conn)
            conn.close()

    def _release(self, conn: _Conn) -> None:
        if not conn.closed and len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
        while self.late:
            self.late.pop().close()
