"""Real backing services as pytest fixtures: a redis-server and the reference memory service.

    redis_server    session   EmbeddedRedis: .url .port .running .stop() .start() .log_tail()
    redis_url       function  the session server's URL; restarted if a test stopped it; FLUSHALLed
    memory_service  session   MemoryServiceHandle for `python -m ibex_context.memory.service.server --enable-faults`
    memory          function  the same handle: running, faults cleared, Redis flushed

A service that cannot start FAILS the test (never skips): CI must not go green without it.
Subprocess output goes to a temp log file whose tail is included in every failure message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ibex_context.memory.embedded_redis.server import EmbeddedRedis, RedisStartError
from ibex_context.memory.service.seed import SeedStats, seed_records
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.connect import async_client, sync_client
from tests.forkserver import Forked, fork_server

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_SECRET = "test-secret-for-ibex-memory"
SERVICE_START_TIMEOUT_S = 90.0  # a bound on a wait for readiness, not a speed claim: CI boxes are shared
STOP_TIMEOUT_S = 10.0
SERVICE_MODULE = "ibex_context.memory.service.server"


def flush_redis(url: str) -> None:
    """FLUSHALL on the server, or on every primary of a cluster URL (``shared.stores.connect``)."""
    with sync_client(url, socket_timeout=2) as client:
        client.flushall()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


class ServiceStartError(RuntimeError):
    pass


class MemoryServiceHandle:
    """A `python -m ibex_context.memory.service.server` process on 127.0.0.1 with faults enabled.

    ``url``/``port`` stay the same across ``stop()``/``start()``/``kill()``/``restart()`` so
    clients configured once keep working. Faults and seeding go through the real service/Redis.
    """

    def __init__(self, *, redis_url: str, secret: str = TEST_SECRET, enable_faults: bool = True,
                 workdir: Path, extra_env: Mapping[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.secret = secret
        self.enable_faults = enable_faults
        self.log_path = workdir / "memory-service.log"
        self._port_file = workdir / "memory-service.port"
        # The hashing embedder unless the test says otherwise (tests/conftest.py says why).
        self._extra_env = {"IBEX_MEMORY_EMBEDDER": os.environ.get("IBEX_MEMORY_EMBEDDER", "hash"), **(extra_env or {})}
        self._port: int | None = None
        self._proc: Forked | None = None

    # ------------------------------------------------------------------------------ addresses

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("memory service has not been started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def token(self, org_id: str) -> str:
        return mint_org_token(self.secret, org_id)

    def headers(self, org_id: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token(org_id)}"}

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> MemoryServiceHandle:
        """Start (a no-op if running) and wait until /healthz answers; ServiceStartError if not."""
        if self.running:
            return self
        self._port_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
        env.update({"IBEX_MEMORY_SECRET": self.secret, "PYTHONUNBUFFERED": "1", **self._extra_env})
        args = ["--host", "127.0.0.1", "--port", str(self._port or 0), "--port-file", str(self._port_file),
                "--redis-url", self.redis_url]
        if self.enable_faults:
            args.append("--enable-faults")
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start python -m {SERVICE_MODULE} {' '.join(args)}\n".encode())
        # Forked from the fork server (tests/forkserver.py): `python -m SERVICE_MODULE ARGS` as the
        # interpreter runs it, without starting and importing a new one each time.
        self._proc = fork_server().run_module(SERVICE_MODULE, args, env=env, cwd=REPO_ROOT, log=self.log_path,
                                              new_session=False)
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while self._port is None or not self._port_file.exists():
            self._check_alive(deadline)
            if self._port_file.exists():
                self._port = int(self._port_file.read_text().strip())
                break
            time.sleep(0.02)
        with httpx.Client(timeout=1.0) as client:
            while True:
                self._check_alive(deadline)
                try:
                    client.get(f"{self.url}/healthz")  # 200, or 503 while Redis is down: up either way
                    return self
                except httpx.TransportError:
                    time.sleep(0.02)

    def _check_alive(self, deadline: float) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            code = self._proc.returncode
            self._proc = None
            raise ServiceStartError(f"memory service exited with status {code}\n--- log tail ---\n"
                                    f"{self.log_tail()}")
        if time.monotonic() > deadline:
            self.kill()
            raise ServiceStartError(f"memory service not up within {SERVICE_START_TIMEOUT_S}s\n"
                                    f"--- log tail ---\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM and wait (graceful shutdown), SIGKILL after a timeout. Safe to call twice."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the service dies mid-whatever, as in a crash."""
        self._end(signal.SIGKILL)

    def restart(self) -> MemoryServiceHandle:
        self.stop()
        return self.start()

    def _end(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # --------------------------------------------------------------------------------- faults

    def set_fault(self, endpoint: str = "all", **spec: Any) -> dict[str, Any]:
        """PUT /_faults: endpoint hot|search|all; latency_ms, status, malformed, drop, huge(_bytes)."""
        with httpx.Client(timeout=5.0) as client:
            resp = client.put(f"{self.url}/_faults", json={"endpoint": endpoint, **spec})
        if resp.status_code != 200:
            raise AssertionError(f"set_fault refused: {resp.status_code} {resp.text}")
        faults: dict[str, Any] = resp.json()["faults"]
        return faults

    def clear_faults(self, endpoint: str = "all") -> None:
        with httpx.Client(timeout=5.0) as client:
            resp = client.delete(f"{self.url}/_faults", params={"endpoint": endpoint})
        if resp.status_code != 200:
            raise AssertionError(f"clear_faults refused: {resp.status_code} {resp.text}")

    # ---------------------------------------------------------------------------------- data

    def seed(self, records: Iterable[Mapping[str, Any]]) -> SeedStats:
        """Write memories / directives (the ``memory.service.seed`` JSONL record format) into Redis.

        Runs on a private event loop in a helper thread, so it works from sync and async tests.
        """
        recs = list(records)

        async def run() -> SeedStats:
            client = async_client(self.redis_url)
            try:
                return await seed_records(client, recs)
            finally:
                await client.aclose()

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, run()).result(timeout=60)

    def flush(self) -> None:
        flush_redis(self.redis_url)


@contextmanager
def memory_service_with(redis_url: str, workdir: Path, **env: str) -> Iterator[MemoryServiceHandle]:
    """A memory service of its own with extra ``IBEX_MEMORY_*`` settings, running for the block."""
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=workdir, extra_env=env)
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


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


def _ensure_redis(server: EmbeddedRedis) -> None:
    if not server.running:  # an earlier test stopped it on purpose
        try:
            server.start()
        except RedisStartError as exc:
            pytest.fail(f"embedded redis-server did not restart: {exc}", pytrace=False)


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    _ensure_redis(redis_server)
    flush_redis(redis_server.url)
    return redis_server.url


@contextlib.contextmanager
def running_memory_service(redis_url: str, prefix: str) -> Iterator[MemoryServiceHandle]:
    """A memory service on ``redis_url`` for the ``with`` block, in a work dir of its own; the test
    fails (never skips) if it cannot start."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=workdir)
    try:
        handle.start()
    except ServiceStartError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield handle
    finally:
        handle.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def healed(handle: MemoryServiceHandle) -> MemoryServiceHandle:
    """``handle`` running again if an earlier test stopped or killed it, with no faults."""
    if not handle.running:
        try:
            handle.start()
        except ServiceStartError as exc:
            pytest.fail(str(exc), pytrace=False)
    handle.clear_faults()
    return handle


@pytest.fixture(scope="session")
def memory_service(redis_server: EmbeddedRedis) -> Iterator[MemoryServiceHandle]:
    with running_memory_service(redis_server.url, "ibex-memsvc-") as handle:
        yield handle


@pytest.fixture
def memory(memory_service: MemoryServiceHandle, redis_url: str) -> MemoryServiceHandle:
    """The session's memory service, running, with no faults and an empty Redis."""
    return healed(memory_service)
