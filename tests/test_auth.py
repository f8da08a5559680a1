"""Caller authentication with CURVE + ZAP on real sockets: orgs come from keys, never from payloads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.client import AsyncClient
from client.stack import LocalStack, free_port
from shared import auth
from shared.errors import DeadlineExceeded, Forbidden, Unauthenticated, Unavailable
from tests.helpers import start_stack

ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "500", "IBEX_HOT_TIMEOUT_MS": "1000",
            "IBEX_COLD_TIMEOUT_MS": "1000", "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_CONTEXT_DEADLINE_MS": "1500"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    for name in ("broker", "worker", "acme-proxy", "globex-proxy", "stranger", "rogue-worker"):
        out = _cli("keys", "generate", "--dir", str(d), "--name", name)
        assert out.returncode == 0, out.stderr
    kf = d / "keys.json"
    for args in (["--role", "client", "--name", "acme-proxy", "--org", "acme", "--agents", "support-bot"],
                 ["--role", "client", "--name", "globex-proxy", "--org", "globex"],
                 ["--role", "worker", "--name", "worker"]):
        name = args[3]
        out = _cli("keys", "register", "--keys-file", str(kf), "--public", str(d / f"{name}.pub"), *args)
        assert out.returncode == 0, out.stderr
    assert (d / "broker.key").stat().st_mode & 0o777 == 0o600
    refused = _cli("keys", "generate", "--dir", str(d), "--name", "broker")
    assert refused.returncode == 2 and "refusing to overwrite" in refused.stderr
    return {"dir": d, "keys": kf}


@pytest.fixture(scope="module")
def secured(keys: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    d = keys["dir"]
    env = {**ENV_FAST, "IBEX_AUTH_KEYS_FILE": str(keys["keys"]), "IBEX_BROKER_KEY_FILE": str(d / "broker.key"),
           "IBEX_BROKER_PUBLIC_KEY": str(d / "broker.pub"), "IBEX_WORKER_KEY_FILE": str(d / "worker.key")}
    ops = auth.curve_client(auth.load_keypair(d / "globex-proxy.key"), auth.load_public_key(str(d / "broker.pub")))
    stack = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=env, status_socket=ops)
    try:
        yield stack
    finally:
        stack.stop()


def _client(stack: LocalStack, keys: dict[str, Path], name: str) -> AsyncClient:
    d = keys["dir"]
    configure = auth.curve_client(auth.load_keypair(d / f"{name}.key"), auth.load_public_key(str(d / "broker.pub")))
    return AsyncClient(stack.frontend, configure_socket=configure)


REQ: dict[str, Any] = {"org_id": "acme", "agent_id": "support-bot", "model": "gpt-4o", "query": "invoice"}


async def test_known_key_for_its_org_is_served(secured: LocalStack, keys: dict[str, Path]) -> None:
    async with _client(secured, keys, "acme-proxy") as c:
        await c.wait_connected()
        resp = await c.assemble(timeout=5.0, **REQ)
    assert resp.request_id and not [d for d in resp.decisions if not d.memory_id]


async def test_payload_org_is_never_trusted(secured: LocalStack, keys: dict[str, Path]) -> None:
    async with _client(secured, keys, "acme-proxy") as c:
        await c.wait_connected()
        with pytest.raises(Forbidden) as exc:
            await c.assemble(timeout=5.0, **{**REQ, "org_id": "globex"})
        assert "not 'globex'" in exc.value.message and exc.value.field == "org_id"
        with pytest.raises(Forbidden) as exc2:
            await c.assemble(timeout=5.0, **{**REQ, "agent_id": "devops-helper"})
        assert exc2.value.field == "agent_id"


async def test_unknown_key_is_refused_at_the_handshake(secured: LocalStack, keys: dict[str, Path]) -> None:
    async with _client(secured, keys, "stranger") as c:
        t0 = time.monotonic()
        with pytest.raises(Unauthenticated):
            await c.assemble(timeout=3.0, **REQ)
        assert time.monotonic() - t0 < 3.0


async def test_plaintext_client_gets_nothing(secured: LocalStack) -> None:
    async with AsyncClient(secured.frontend) as c:
        with pytest.raises((Unavailable, DeadlineExceeded)):
            await c.assemble(timeout=0.5, **REQ)


def test_unknown_worker_cannot_join(secured: LocalStack, keys: dict[str, Path]) -> None:
    d = keys["dir"]
    rogue = LocalStack(workers=0)
    rogue.backend, rogue.frontend = secured.backend, secured.frontend
    rogue.extra_env = {"IBEX_WORKER_KEY_FILE": str(d / "rogue-worker.key"),
                       "IBEX_BROKER_PUBLIC_KEY": str(d / "broker.pub"), "IBEX_REDIS_URL": str(secured.redis_url)}
    proc = rogue.start_worker(7)
    try:
        time.sleep(2.0)  # several heartbeats
        st = secured.status()
        assert st is not None and list(st["workers"]) == ["w0"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_auth_off_refuses_non_loopback_binds(tmp_path: Path) -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "broker", "--frontend", f"tcp://0.0.0.0:{port}",
                          "--backend", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 2
    assert "refusing to bind tcp://0.0.0.0" in out.stderr and "IBEX_AUTH_KEYS_FILE" in out.stderr


def test_loopback_and_ipc_are_local() -> None:
    """The forms the guard accepts; every bypass form is in tests/test_endpoint_guard.py."""
    for ok in ("tcp://127.0.0.1:5555", "ipc:///tmp/x", "tcp://[::1]:1"):
        assert auth.exposure(ok) is None
    assert auth.exposure("tcp://0.0.0.0:5555") and auth.exposure("tcp://10.1.2.3:5555")
    with pytest.raises(auth.AuthConfigError, match=r"10\.0\.0\.1 is not a loopback address"):
        auth.require_auth_or_loopback(["tcp://10.0.0.1:5555"], auth_on=False)
    auth.require_auth_or_loopback(["tcp://10.0.0.1:5555"], auth_on=True)


def test_bad_keys_files_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "k.json"
    bad.write_text('{"clients": [{"public_key": "short", "org_id": "acme"}]}')
    with pytest.raises(auth.AuthConfigError, match="z85"):
        auth.KeyRing.load(bad)
    bad.write_text('{"clients": [{"org_id": "acme"}]}')
    with pytest.raises(auth.AuthConfigError, match="public_key"):
        auth.KeyRing.load(bad)
    with pytest.raises(auth.AuthConfigError, match="cannot read"):
        auth.KeyRing.load(tmp_path / "absent.json")


def test_public_keys_starting_with_a_brace_load(tmp_path: Path) -> None:
    """z85 has '{' in its alphabet: a .pub file whose key starts with it is a key, not JSON (this
    made the key fixtures fail about once in thirty runs)."""
    kp = auth.generate_keypair()
    while not kp.public.startswith(b"{"):
        kp = auth.generate_keypair()
    (tmp_path / "k.pub").write_text(kp.public.decode() + "\n")
    assert auth.load_public_key(str(tmp_path / "k.pub")) == kp.public
    (tmp_path / "k.key").write_text(json.dumps({"public_key": kp.public.decode(), "secret_key": "x"}))
    assert auth.load_public_key(str(tmp_path / "k.key")) == kp.public
    (tmp_path / "bad.key").write_text('{"no_key": 1, "padding": "' + "x" * 40 + '"}')
    with pytest.raises(auth.AuthConfigError):
        auth.load_public_key(str(tmp_path / "bad.key"))
