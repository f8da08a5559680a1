"""The memory service's Redis connections (``memory.store.resp``): hiredis packs what redis-py would,
byte for byte, and what it cannot pack goes through redis-py, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from ibex_context.memory.store.resp import HiredisPackedConnection

ARGS = [("SET", "k", "v"), ("CONFIG GET", "maxmemory"), ("HSET", "h", "f", 1735689600.25, "n", 3, "b", b"\x00\xff"),
        ("FT.SEARCH", "idx", "@content:caf\u00e9", "INKEYS", "2", "a", "b")]


@pytest.mark.parametrize("args", ARGS)
def test_packed_bytes_match_redis_py(args: tuple[object, ...]) -> None:
    ours, theirs = HiredisPackedConnection(), Connection()
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


def test_what_hiredis_refuses_goes_through_redis_py() -> None:
    conn = HiredisPackedConnection()
    view = memoryview(b"vector-bytes")
    assert b"".join(bytes(p) for p in conn.pack_command("SET", "k", view)).endswith(b"vector-bytes\r\n")
    with pytest.raises(DataError):
        conn.pack_command("SET", "k", True)


async def test_a_real_server_answers_packed_commands(redis_url: str) -> None:
    client = Redis.from_url(redis_url, connection_class=HiredisPackedConnection, protocol=3)
    try:
        vec = np.arange(4, dtype=np.float32).tobytes()
        await client.hset("resp:test", mapping={"v": vec, "t": 1.5, "s": "caf\u00e9"})
        assert await client.hmget("resp:test", ["v", "t", "s"]) == [vec, b"1.5", "caf\u00e9".encode()]
        assert await client.execute_command("CONFIG GET", "maxmemory")
    finally:
        await client.delete("resp:test")
        await client.aclose()
