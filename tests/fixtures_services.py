"""Real backing services as pytest fixtures: a redis-server and the reference memory service.

    redis_server    session   EmbeddedRedis: .url .port .stop() .start() .running .log_tail()
    redis_url       function  the session server's URL, restarted if a test stopped it, FLUSHALLed
    memory_service  session   MemoryService handle (below): `python -m memory.server --enable-faults`
    memory          function  the same handle, running, faults cleared, Redis flushed

A service that cannot start FAILS the test (never skips): CI must not go green without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from memory.redis_server import EmbeddedRedis, RedisStartError

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_SECRET = "test-secret-for-ibex-memory"
SERVICE_START_TIMEOUT_S = 20.0


def flush_redis(url: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=2) as client:
        client.flushall()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    try:
        server.start()
    except RedisStartError as exc:
        pytest.fail(f"embedded redis-server did not start: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    if not redis_server.running:  # an earlier test stopped it on purpose
        redis_server.start()
    flush_redis(redis_server.url)
    return redis_server.url
