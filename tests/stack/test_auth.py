"""Caller authentication with CURVE + ZAP on real sockets: orgs come from keys, never from payloads.

Here: the checks through running servers; the pure parts are in
tests/unit/test_auth.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack, free_port, port_in_use, wait_for
from ibex_context.shared.security import auth
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.errors import Forbidden, Unauthenticated, Unavailable
from tests.helpers import start_stack
from tests.unit.test_auth import _keys_doc

ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "500", "IBEX_HOT_TIMEOUT_MS": "1000",
            "IBEX_COLD_TIMEOUT_MS": "1000", "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_CONTEXT_DEADLINE_MS": "1500"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], capture_output=True, text=True,
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
        with pytest.raises(Unavailable, match=r"^cannot send to broker tcp://") as exc:
            await c.assemble(timeout=0.5, **REQ)  # the handshake never completes: nothing is connected
        assert exc.type is Unavailable


HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _backend_dealer(ctx: zmq.Context[zmq.Socket[bytes]], stack: LocalStack, keys: dict[str, Path],
                    name: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER on the broker's backend with NAME's CURVE key, and a monitor of its handshakes."""
    d = keys["dir"]
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.curve_client(auth.load_keypair(d / f"{name}.key"), auth.load_public_key(str(d / "broker.pub")))(sock)
    monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    sock.connect(stack.backend)
    return sock, monitor


def _first_handshake(monitor: zmq.Socket[bytes], timeout_s: float = 10.0) -> dict[str, Any]:
    """The first handshake outcome the monitor reports; fails the test if none comes in time."""
    if not monitor.poll(int(timeout_s * 1000)):
        pytest.fail(f"no handshake event within {timeout_s}s")
    return dict(recv_monitor_message(monitor))


async def test_unknown_worker_is_refused_at_the_handshake(secured: LocalStack, keys: dict[str, Path]) -> None:
    """A worker key missing from the keys file fails the CURVE handshake (ZAP answers 400), so its
    READY never reaches the broker and it is sent no request while the listed worker serves
    (docs/security.md "Authentication"). A DEALER with the listed worker key is the control: it completes
    the handshake on the same endpoint."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rogue, rogue_mon = _backend_dealer(ctx, secured, keys, "rogue-worker")
    listed, listed_mon = _backend_dealer(ctx, secured, keys, "worker")
    try:
        # Without a peer a DEALER's send blocks: once the refused handshake has dropped its only
        # pipe there is none, and the READY has nowhere to go (which is the point).
        with contextlib.suppress(zmq.Again):
            rogue.send_multipart([P.TAG, P.READY, P.Info(16, "rogue", os.getpid()).pack()], flags=zmq.NOBLOCK)
        refused = _first_handshake(rogue_mon)
        assert (refused["event"], refused["value"]) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
        assert _first_handshake(listed_mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        async with _client(secured, keys, "acme-proxy") as c:
            await c.wait_connected()
            served = [await c.assemble(timeout=5.0, **{**REQ, "request_id": f"rogue-{i}"}) for i in range(5)]
        assert [r.worker_id for r in served] == ["w0"] * 5
        assert rogue.poll(0) == 0  # not one request (nor heartbeat) reached the rogue
        st = secured.status()
        assert st is not None and list(st["workers"]) == ["w0"]
    finally:
        for sock in (rogue, rogue_mon, listed, listed_mon):
            sock.close(linger=0)
        ctx.term()


def test_auth_off_refuses_non_loopback_binds(tmp_path: Path) -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "ibex_context.broker", "--frontend", f"tcp://0.0.0.0:{port}",
                          "--backend", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 2
    assert "refusing to bind tcp://0.0.0.0" in out.stderr and "IBEX_AUTH_KEYS_FILE" in out.stderr


def _start_broker(env: dict[str, str], front: int, back: int) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    return subprocess.Popen([sys.executable, "-m", "ibex_context.broker", "--frontend", f"tcp://127.0.0.1:{front}",
                             "--backend", f"tcp://127.0.0.1:{back}"], env={**clean, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_broker_refuses_a_key_in_two_roles(tmp_path: Path) -> None:
    """The real broker exits 2 with the keys file's one-line reason and binds nothing; the same
    start-up with the key in one role listens (so the test can tell the two apart)."""
    auth.write_keypair(tmp_path, "broker")
    _, acme_pub = auth.write_keypair(tmp_path, "acme-proxy")
    _, worker_pub = auth.write_keypair(tmp_path, "worker")
    acme, worker = acme_pub.read_text().strip(), worker_pub.read_text().strip()
    kf = tmp_path / "keys.json"
    kf.write_text(_keys_doc([{"name": "acme-proxy", "public_key": acme, "org_id": "acme"}],
                            [{"name": "worker", "public_key": worker}, {"name": "acme-as-worker", "public_key": acme}]))
    env = {"IBEX_AUTH_KEYS_FILE": str(kf), "IBEX_BROKER_KEY_FILE": str(tmp_path / "broker.key")}
    front, back = free_port(), free_port()
    proc = _start_broker(env, front, back)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the broker started with a key in two roles")
    assert proc.returncode == 2 and out == ""
    assert err.splitlines() == [f"broker: keys file {kf}: clients[0] ('acme-proxy') and workers[1] ('acme-as-worker') "
                                "are the same public key; a key has one role (client or worker), give each its "
                                "own keypair"]
    assert not port_in_use("127.0.0.1", front) and not port_in_use("127.0.0.1", back)

    kf.write_text(_keys_doc([{"name": "acme-proxy", "public_key": acme, "org_id": "acme"}],
                            [{"name": "worker", "public_key": worker}]))
    proc = _start_broker(env, front, back)
    try:
        wait_for("the broker's backend", lambda: port_in_use("127.0.0.1", back) or proc.poll() is not None, 20)
        assert proc.poll() is None and port_in_use("127.0.0.1", back)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


async def test_usage_reports_are_authorized_like_requests(secured: LocalStack, keys: dict[str, Path]) -> None:
    """docs/assembly.md "Calibrated token counts": a report's org comes from the caller's key, so one tenant
    cannot move another's calibration by replaying (or forging) its assembly."""
    async with _client(secured, keys, "acme-proxy") as acme:
        await acme.wait_connected()
        resp = await acme.assemble(timeout=5.0, **{**REQ, "format": "openai",
                                                   "messages": [{"role": "user", "content": "my invoice?"}]})
        assert resp.org_id == "acme" and resp.prompt_tokens_uncalibrated
        before = secured.status(2.0)
        assert before is not None
        acme.report_usage(resp, prompt_tokens=resp.prompt_tokens_uncalibrated)
        async with _client(secured, keys, "globex-proxy") as globex:
            await globex.wait_connected()
            globex.report_usage(resp, prompt_tokens=1)  # acme's assembly, globex's key
            for _ in range(250):
                if globex.stats["usage_refused"]:
                    break
                await asyncio.sleep(0.02)
            assert globex.stats["usage_sent"] == 1 and globex.stats["usage_refused"] == 1
    after = secured.status(2.0)
    assert after is not None
    grow = {k: after["stats"].get(k, 0) - before["stats"].get(k, 0)
            for k in ("usage_forwarded", "usage_rejected_forbidden")}
    assert grow == {"usage_forwarded": 1, "usage_rejected_forbidden": 1}
