"""The development token secret stays on loopback (docs/security.md "Degradation and security").

The default ``IBEX_MEMORY_SECRET`` is in the source, so a memory service listening beyond
loopback with it, or a worker minting tokens with it for a memory service beyond loopback, would
let anyone mint a token for any org. Both refuse to start (exit 2, one line naming the variable);
fault injection, which needs no token, is refused off loopback whatever the secret. These tests
run the real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ibex_context.memory.service.config import DEV_SECRET, MemoryConfig
from ibex_context.ops.stack import free_port
from ibex_context.shared.config.settings import Settings
from tests.fixtures_services import REPO_ROOT, MemoryServiceHandle
from tests.helpers import http

PRIVATE_SECRET = "a-private-secret-for-this-test"
START_TIMEOUT_S = 20.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _run(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"ibex_context.{module}", *args], capture_output=True, text=True,
                          env=env,
                          cwd=REPO_ROOT, timeout=60)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


def _wait_for(what: str, check: object, proc: subprocess.Popen[bytes], log: Path) -> None:
    assert callable(check)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not check():
        if proc.poll() is not None:
            pytest.fail(f"{what}: exited with {proc.returncode}\n{log.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {START_TIMEOUT_S}s\n{log.read_text(errors='replace')}")
        time.sleep(0.02)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_the_two_defaults_are_one_secret() -> None:
    assert DEV_SECRET == Settings.model_fields["memory_secret"].default
    assert MemoryConfig().uses_dev_secret and not MemoryConfig(secret=PRIVATE_SECRET).uses_dev_secret


# ------------------------------------------------------------------------------ memory service


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "lo", "localhost.example.com"])
def test_memory_service_refuses_a_public_bind_with_the_dev_secret(host: str, how: str, redis_url: str) -> None:
    args = ["--port", "0", "--redis-url", redis_url]
    env = _env()
    if how == "flag":
        args += ["--host", host]
    else:
        env["IBEX_MEMORY_HOST"] = host
    r = _run("memory.service.server", *args, env=env)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "IBEX_MEMORY_SECRET" in line and repr(host) in line


def test_memory_service_refuses_faults_off_loopback(redis_url: str) -> None:
    r = _run("memory.service.server", "--host", "0.0.0.0", "--port", "0", "--redis-url", redis_url, "--enable-faults",
             env=_env(IBEX_MEMORY_SECRET=PRIVATE_SECRET))
    assert r.returncode == 2, r.stderr
    assert "--enable-faults" in _one_error_line(r.stderr)


def test_memory_service_with_a_private_secret_listens_anywhere(redis_url: str, tmp_path: Path) -> None:
    port_file, log = tmp_path / "port", tmp_path / "memory.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ibex_context.memory.service.server", "--host", "0.0.0.0",
                                 "--port", "0", "--port-file", str(port_file), "--redis-url", redis_url],
                                env=_env(IBEX_MEMORY_SECRET=PRIVATE_SECRET), cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("memory service", port_file.exists, proc, log)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"

        def healthy() -> bool:
            try:
                return http().get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait_for("memory service /healthz", healthy, proc, log)
        assert http().put(f"{url}/_faults", json={"endpoint": "hot", "status": 500}, timeout=5).status_code == 404
    finally:
        _stop(proc)


def test_memory_service_on_loopback_still_starts_with_the_dev_secret(redis_url: str, tmp_path: Path) -> None:
    handle = MemoryServiceHandle(redis_url=redis_url, secret=DEV_SECRET, enable_faults=True, workdir=tmp_path)
    handle.start()
    try:
        with httpx.Client(base_url=handle.url, timeout=5) as client:
            assert client.get("/healthz").json()["faults_enabled"] is True
            r = client.get("/v1/memories/hot", params={"agent_id": "bot"}, headers=handle.headers("acme"))
            assert r.status_code == 200 and r.json() == {"memories": []}
    finally:
        handle.stop()


# ------------------------------------------------------------------------------------- worker


@pytest.mark.parametrize("url", ["http://10.1.2.3:8765", "http://memory.internal:8765", "http://0.0.0.0:8765",
                                 "http://127.0.0.1.example.com:8765", "http://user@127.0.0.1:8765"])
def test_worker_refuses_a_remote_memory_service_with_the_dev_secret(url: str, redis_url: str) -> None:
    r = _run("worker", "--cpu", "0", env=_env(IBEX_MEMORY_URL=url, IBEX_REDIS_URL=redis_url))
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "IBEX_MEMORY_URL" in line and "IBEX_MEMORY_SECRET" in line
    assert "secret-password" not in line


def test_worker_does_not_echo_credentials_in_the_url(redis_url: str) -> None:
    r = _run("worker", env=_env(IBEX_MEMORY_URL="http://svc:secret-password@10.0.0.5:8765", IBEX_REDIS_URL=redis_url))
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "'10.0.0.5'" in line and "secret-password" not in line


def test_worker_on_loopback_starts_and_logs_the_cpu_count_before_pinning(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    env = _env(IBEX_MEMORY_URL=f"http://127.0.0.1:{free_port()}", IBEX_REDIS_URL=redis_url,
               IBEX_BROKER_BACKEND=f"tcp://127.0.0.1:{free_port()}", IBEX_PIN_CPUS="true")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ibex_context.worker", "--cpu", "1", "--worker-id", "guard"],
                                env=env,
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("worker start-up line", lambda: "pinned to cpu" in log.read_text(errors="replace"), proc, log)
        assert proc.poll() is None, log.read_text()
        [line] = [x for x in log.read_text().splitlines() if "pinned to cpu" in x]
        cpus = sorted(os.sched_getaffinity(0))
        assert line.endswith(f"worker guard pinned to cpu {cpus[1 % len(cpus)]} of {len(cpus)}"), line
    finally:
        _stop(proc)
