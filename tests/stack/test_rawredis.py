"""worker.rawredis against real redis-servers: the shared embedded one (TCP) and a private one on
a Unix socket with a password and an ACL user, so every URL form it serves is exercised."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from ibex_context.memory.embedded_redis.server import EmbeddedRedis, RedisStartError
from ibex_context.worker.rawredis import Connection, ReplyError


@pytest.fixture(scope="module")
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Unix-socket redis-server with ``requirepass s3cret`` and a user ``bot`` (password ``pw``)."""
    server = EmbeddedRedis(unix_socket=True)
    try:
        server.start()
    except RedisStartError as exc:
        pytest.fail(f"embedded redis-server did not start: {exc}", pytrace=False)

    async def protect() -> None:
        r = Redis.from_url(server.url)
        await r.execute_command("ACL", "SETUSER", "bot", "on", ">pw", "~*", "+@all")
        await r.config_set("requirepass", "s3cret")
        await r.aclose()

    asyncio.run(protect())
    try:
        yield server
    finally:
        server.close()


async def test_get_reads_values_misses_and_the_urls_db(redis_url: str) -> None:
    setter = Redis.from_url(redis_url)
    await setter.set("acme:directive:bot", b"\x00binary\xff")
    await setter.execute_command("SELECT", 1)
    one = Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    await one.set("acme:directive:bot", b"db one")
    await one.aclose()
    await setter.aclose()
    c = Connection.for_url(redis_url, max_idle=2)
    c1 = Connection.for_url(redis_url.rsplit("/", 1)[0] + "/1", max_idle=2)
    assert c is not None and c1 is not None
    try:
        assert await c.get("acme:directive:bot") == b"\x00binary\xff"
        assert await c.get("acme:directive:nobody") is None
        assert await c1.get("acme:directive:bot") == b"db one"
        assert len(c.idle) == 1  # one connection, kept and reused
    finally:
        c.close()
        c1.close()


async def test_an_error_reply_is_a_reply_error_and_the_connection_stays_usable(redis_url: str) -> None:
    setter = Redis.from_url(redis_url)
    await setter.hset("acme:directive:hash", mapping={"text": "x"})
    await setter.aclose()
    c = Connection.for_url(redis_url, max_idle=2)
    assert c is not None
    try:
        with pytest.raises(ReplyError, match="WRONGTYPE"):
            await c.get("acme:directive:hash")
        assert await c.get("acme:directive:none") is None
    finally:
        c.close()


async def test_a_cancelled_get_closes_its_connection(redis_url: str) -> None:
    admin = Redis.from_url(redis_url)
    c = Connection.for_url(redis_url, max_idle=2)
    assert c is not None
    try:
        assert await c.get("k") is None
        await admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await c.get("k")
        assert c.idle == []
        assert await c.get("k") is None  # on a new connection, answered once the pause ends
    finally:
        c.close()
        await admin.aclose()


async def test_unix_socket_password_and_acl_user(private_redis: EmbeddedRedis) -> None:
    path = private_redis.socket_path
    for url in (f"unix://:s3cret@{path}?db=0", f"unix://bot:pw@{path}?db=2"):
        c = Connection.for_url(url, max_idle=1)
        assert c is not None and c.path == path
        try:
            assert await c.get("k") is None
        finally:
            c.close()
    wrong = Connection.for_url(f"unix://:nope@{path}?db=0", max_idle=1)
    assert wrong is not None
    with pytest.raises(ConnectionError, match="Redis refused AUTH"):
        await wrong.get("k")


async def test_refused_and_unsupported_urls() -> None:
    assert Connection.for_url("rediss://127.0.0.1:6380/0", max_idle=1) is None  # TLS stays on redis-py
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    c = Connection.for_url(f"redis://127.0.0.1:{port}/0", max_idle=1)
    assert c is not None
    with pytest.raises(ConnectionError, match="cannot connect to Redis"):
        await c.get("k")
