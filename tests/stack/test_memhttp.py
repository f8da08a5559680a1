"""worker.memhttp over real loopback TCP: a scripted HTTP/1.1 server answers each request as a
test says (keep-alive, chunked, oversized, closed, late), so the client's contract is checked on
the edges the reference memory service does not reach on its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from ibex_context.worker import memhttp
from ibex_context.worker.memhttp import (
    ConnectError,
    MalformedResponse,
    MemoryHTTP,
    ResponseTooLarge,
    ServerDisconnectedError,
)
from tests.helpers import eventually

Script = Callable[[bytes, int], bytes | None]  # (request head, per-connection index) -> reply; None: close


class Server:
    """Answers every request from ``script``; counts connections and keeps what it was sent."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.delay_s = 0.0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        i = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                reply = self.script(head, i)
                i += 1
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


Serve = Callable[[Script], Awaitable[Server]]


def ok(body: bytes, *, close: bool = False) -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    made: list[Server] = []

    async def start(script: Script) -> Server:
        s = Server(script)
        s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        made.append(s)
        return s

    yield start
    for s in made:
        assert s.server is not None
        s.server.close()


def _client(url: str, max_body: int = 1 << 20) -> MemoryHTTP:
    return MemoryHTTP(url, max_body=max_body, max_idle=4)


async def test_keep_alive_reuses_one_connection_and_sends_a_well_formed_request(serve: Serve) -> None:
    s = await serve(lambda head, i: ok(b'{"n": %d}' % i))
    c = _client(s.url + "/base/")
    try:
        for i in range(3):
            req = c.request_bytes("GET", "/v1/memories/hot", b"Authorization: Bearer t\r\n",
                                  params={"agent_id": "a b", "query": "é&x"})
            assert await c.request(req) == (200, b'{"n": %d}' % i)
        post = c.request_bytes("POST", "/v1/memories/search", b"", body=b'{"q":1}')
        assert await c.request(post) == (200, b'{"n": 3}')
    finally:
        c.close()
    assert s.connections == 1
    first = s.requests[0].decode()
    assert first.startswith("GET /base/v1/memories/hot?agent_id=a+b&query=%C3%A9%26x HTTP/1.1\r\n")
    assert "\r\nHost: 127.0.0.1:" in first and "\r\nAuthorization: Bearer t\r\n" in first
    assert s.requests[3].endswith(b'Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{"q":1}')


async def test_chunked_bodies_are_joined_and_limited(serve: Serve) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    s = await serve(lambda head, i: chunked)
    c = _client(s.url)
    try:
        assert await c.request(c.request_bytes("GET", "/x", b"")) == (200, b"hello world")
    finally:
        c.close()
    small = _client(s.url, max_body=8)
    try:
        with pytest.raises(ResponseTooLarge):
            await small.request(small.request_bytes("GET", "/x", b""))
        assert small.idle == []  # a refused body's connection is not kept
    finally:
        small.close()


async def test_a_status_and_a_closing_server_are_told_apart(serve: Serve) -> None:
    busy = b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy"
    s = await serve(lambda head, i: busy if len(s.requests) == 1 else None)  # the first request only
    c = _client(s.url)
    try:
        assert await c.request(c.request_bytes("GET", "/x", b"")) == (503, b"busy")
        with pytest.raises(ServerDisconnectedError):  # the kept connection, then a fresh one, both closed
            await c.request(c.request_bytes("GET", "/x", b""))
    finally:
        c.close()
    garbage = await serve(lambda head, i: b"SMTP ready\r\n\r\n")
    g = _client(garbage.url)
    try:
        with pytest.raises(MalformedResponse):
            await g.request(g.request_bytes("GET", "/x", b""))
    finally:
        g.close()


async def test_a_keep_alive_the_server_ended_is_retried_on_a_new_connection(serve: Serve) -> None:
    s = await serve(lambda head, i: ok(b"one", close=False) if i == 0 else None)
    c = _client(s.url)
    try:
        assert await c.request(c.request_bytes("GET", "/x", b"")) == (200, b"one")
        assert len(c.idle) == 1
        # The server closes that connection on its next request without answering: the client
        # read nothing from it, so it retries once, on a new connection (which answers "one").
        assert await c.request(c.request_bytes("GET", "/x", b"")) == (200, b"one")
        assert s.connections == 2
    finally:
        c.close()


async def test_a_cancelled_call_never_hands_its_late_answer_to_the_next(serve: Serve) -> None:
    s = await serve(lambda head, i: ok(head.split(b" ")[1]))
    s.delay_s = 0.2
    c = _client(s.url)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await c.request(c.request_bytes("GET", "/late", b""))
        assert c.idle == [] and len(c.late) == 1  # kept aside until its answer is read
        s.delay_s = 0.0
        assert await c.request(c.request_bytes("GET", "/next", b"")) == (200, b"/next")  # on a new connection
        assert s.connections == 2
        # the late answer arrives, is dropped, and its connection is reusable
        await eventually("the late answer read", lambda: c.late == set())
        assert len(c.idle) == 2
        for path in (b"/a", b"/b", b"/c"):
            assert await c.request(c.request_bytes("GET", path.decode(), b"")) == (200, path)
        assert s.connections == 2
    finally:
        c.close()


async def test_a_late_answer_that_never_comes_closes_its_connection(serve: Serve,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memhttp, "LATE_S", 0.1)
    s = await serve(lambda head, i: ok(b"x"))
    s.delay_s = 5.0
    c = _client(s.url)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await c.request(c.request_bytes("GET", "/never", b""))
        (conn,) = c.late
        await eventually("the late connection given up", lambda: c.late == set())
        assert conn.closed and c.idle == []
    finally:
        c.close()


async def test_refused_and_bad_urls() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        MemoryHTTP("unix:///tmp/x", max_body=1, max_idle=1)
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    c = _client(f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectError, match="cannot connect to the memory service"):
        await c.request(c.request_bytes("GET", "/x", b""))
