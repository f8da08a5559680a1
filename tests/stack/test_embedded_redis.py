"""The embedded redis-server: a real server, private, ephemeral, restartable, and loud on failure."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ibex_context.memory.embedded_redis.server import EmbeddedRedis, RedisStartError, free_port, resolve_redis_url
from ibex_context.shared.config.settings import Settings


def _ping(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as c:
            return bool(c.ping())
    except redis.exceptions.ConnectionError:
        return False


def test_starts_pings_and_cleans_up() -> None:
    with EmbeddedRedis() as server:
        assert server.running and server.port is not None
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(server.url) as c:
            assert c.config_get("save") == {"save": ""}
            assert c.config_get("appendonly") == {"appendonly": "no"}
            assert c.config_get("bind")["bind"].startswith("127.0.0.1")
        workdir = Path(str(server._dir))
        assert workdir.is_dir()
        pid = server.pid
    assert not server.running
    assert not workdir.exists()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    assert not _ping(server.url)


def test_the_bundled_server_is_redis_8_with_the_query_engine() -> None:
    with EmbeddedRedis() as server, redis.Redis.from_url(server.url) as c:
        assert int(str(c.info("server")["redis_version"]).split(".")[0]) >= 8
        assert b"search" in {m[b"name"] for m in c.module_list()}
        c.execute_command("FT.CREATE", "t", "ON", "HASH", "PREFIX", "1", "t:", "SCHEMA", "body", "TEXT",
                          "v", "VECTOR", "HNSW", "6", "TYPE", "FLOAT32", "DIM", "2", "DISTANCE_METRIC", "COSINE")
        c.hset("t:1", mapping={"body": "hello world", "v": b"\x00\x00\x80\x3f\x00\x00\x00\x00"})
        assert c.execute_command("FT.SEARCH", "t", "hello", "NOCONTENT")[b"total_results"] == 1


def test_stop_start_reuses_port_and_forgets_data() -> None:
    with EmbeddedRedis() as server:
        url = server.url
        with redis.Redis.from_url(url) as c:
            c.set("k", "v")
        server.stop()
        assert not _ping(url)
        server.stop()  # idempotent
        server.start()
        assert server.url == url
        with redis.Redis.from_url(url) as c:
            assert c.get("k") is None  # nothing persisted


def test_unix_socket() -> None:
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        assert _ping(server.url)
        sock = server.socket_path
        assert sock is not None and stat.S_ISSOCK(os.stat(sock).st_mode)
    assert not os.path.exists(sock)


def test_a_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot open config, giving up'\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RedisStartError) as info:
        EmbeddedRedis(executable=str(fake)).start()
    msg = str(info.value)
    assert "exited with status 3" in msg and "FATAL: cannot open config" in msg


def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "mute-redis"
    fake.write_text("#!/bin/sh\necho 'starting slowly'\nexec sleep 30\n")
    fake.chmod(0o755)
    server = EmbeddedRedis(executable=str(fake), startup_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RedisStartError) as info:
        server.start()
    assert time.monotonic() - t0 < 5
    assert "did not answer PING within 0.5s" in str(info.value) and "starting slowly" in str(info.value)
    assert not server.running


def test_resolve_redis_url() -> None:
    url, server = resolve_redis_url(Settings(redis_url="redis://10.0.0.1:6379/2"))
    assert (url, server) == ("redis://10.0.0.1:6379/2", None)
    url, server = resolve_redis_url("redis://example:1/0")
    assert server is None
    url, server = resolve_redis_url(Settings(redis_url=None))
    assert server is not None
    try:
        assert _ping(url)
    finally:
        server.close()
    assert not server.running


def test_session_server_can_be_stopped_and_started(redis_server: EmbeddedRedis, redis_url: str) -> None:
    port = redis_server.port
    redis_server.stop()
    assert not _ping(redis_url)
    redis_server.start()
    assert redis_server.port == port and _ping(redis_url)


def test_foreground_mode_execs_the_server(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ibex_context.memory.embedded_redis.server", "--port", str(port),
         "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not _ping(url):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "foreground redis did not come up"
            time.sleep(0.05)
        # exec'd: the pid we started IS redis-server, so a supervisor's signal reaches it
        assert os.readlink(f"/proc/{proc.pid}/exe").endswith("redis-server")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


# ------------------------------------------------------------------ persistence (the make up stack)


def test_data_dir_keeps_data_across_stop_start_and_a_new_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = EmbeddedRedis(data_dir=data)
    with server:
        with redis.Redis.from_url(server.url) as c:
            assert c.config_get("appendonly") == {"appendonly": "yes"}
            c.set("k", "v")
            c.hset("h", mapping={"a": "1"})
        server.stop()
        assert any((data / "appendonlydir").glob("*.aof"))  # the data dir outlives the server ...
        server.start()
        with redis.Redis.from_url(server.url) as c:
            assert c.get("k") == b"v"
        logdir = Path(str(server._dir))
    assert data.is_dir() and not logdir.exists()  # ... the temp dir (its log) does not
    with EmbeddedRedis(data_dir=data) as again, redis.Redis.from_url(again.url) as c:
        assert c.get("k") == b"v" and c.hgetall("h") == {b"a": b"1"}


def test_foreground_persist_mode_keeps_data_across_a_supervisor_restart(tmp_path: Path) -> None:
    """The command supervisord.conf runs: SIGTERM (supervisorctl stop / make down), start, read back."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    data = tmp_path / "run" / "redis"  # created by the command, as .run/redis is on a fresh checkout

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ibex_context.memory.embedded_redis.server", "--port", str(port), "--dir", str(data),
             "--persist"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while not _ping(url):
            assert proc.poll() is None, "foreground redis exited"
            assert time.monotonic() < deadline, "foreground redis did not come up"
            time.sleep(0.05)
        return proc

    proc = start()
    try:
        with redis.Redis.from_url(url) as c:
            c.set("directive", "kept")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        proc = start()
        with redis.Redis.from_url(url) as c:
            assert c.get("directive") == b"kept"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_supervisord_runs_the_embedded_redis_with_persistence_under_run() -> None:
    import configparser

    conf = configparser.RawConfigParser()
    conf.read(Path(__file__).resolve().parents[2] / "supervisord.conf")
    command = conf.get("program:redis", "command")
    assert "-m ibex_context.memory.embedded_redis.server" in command
    assert "--persist" in command and "--dir %(ENV_IBEX_RUN_DIR)s/redis" in command
