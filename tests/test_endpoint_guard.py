"""The broker's no-auth guard: only endpoints no other host can reach are bound without CURVE.

ZeroMQ's ``tcp://source;bind`` form binds the part after ``;`` and names, interfaces and ``*``
are resolved at bind time, so each of those must be refused, both in the check and by a real
``python -m ibex_context.broker`` (docs/security.md "Authentication").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ibex_context.ops.stack import free_port, port_in_use
from ibex_context.shared.security import auth

LOCAL = ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:*", "tcp://127.8.9.10:5555", "tcp://[::1]:5555",
         "tcp://localhost:5555", "ipc:///tmp/ibex.sock", "inproc://broker"]

# (endpoint template with {p} for a free port, phrase the refusal must contain)
BYPASSES = [
    ("tcp://127.0.0.1:{q};127.0.0.1:{p}", "';' source-address syntax is not accepted"),
    ("tcp://127.0.0.1:1;0.0.0.0:{p}", "';' source-address syntax is not accepted"),
    ("tcp://127.0.0.1:1;*:{p}", "';' source-address syntax is not accepted"),
    ("tcp://127.0.0.1:1;eth0:{p}", "';' source-address syntax is not accepted"),
    ("tcp://127.0.0.1:1;lo:{p}", "';' source-address syntax is not accepted"),
    ("tcp://127.0.0.1.x:{p}", "host '127.0.0.1.x' is not an IP literal or 'localhost'"),
    ("tcp://0.0.0.0:{p}", "0.0.0.0 is not a loopback address"),
    ("tcp://*:{p}", "host '*' is not an IP literal"),
    ("tcp://eth0:{p}", "host 'eth0' is not an IP literal"),
    ("tcp://lo:{p}", "host 'lo' is not an IP literal"),
    ("tcp://localhost.example.com:{p}", "is not an IP literal or 'localhost'"),
    ("tcp://[::]:{p}", "[::] is not a loopback address"),
    ("tcp://::1:{p}", "an IPv6 host needs brackets"),
    ("tcp://10.1.2.3:{p}", "10.1.2.3 is not a loopback address"),
    ("tcp://127.0.0.1:x{p}", "is not a number or '*'"),
    ("ws://127.0.0.1:{p}", "only tcp://, ipc:// and inproc://"),
]


@pytest.mark.parametrize("endpoint", LOCAL)
def test_local_forms_need_no_auth(endpoint: str) -> None:
    assert auth.exposure(endpoint) is None
    auth.require_auth_or_loopback([endpoint], auth_on=False)


@pytest.mark.parametrize(("template", "phrase"), BYPASSES)
def test_bypass_forms_are_refused_with_the_reason(template: str, phrase: str) -> None:
    endpoint = template.format(p=5755, q=5760)
    reason = auth.exposure(endpoint)
    assert reason is not None and phrase in reason
    with pytest.raises(auth.AuthConfigError) as exc:
        auth.require_auth_or_loopback(["tcp://127.0.0.1:5556", endpoint], auth_on=False)
    message = str(exc.value)
    assert message.startswith(f"refusing to bind {endpoint} without authentication: ")
    assert phrase in message and "IBEX_AUTH_KEYS_FILE" in message and "\n" not in message
    auth.require_auth_or_loopback([endpoint], auth_on=True)  # CURVE on: any endpoint


def test_an_unprintable_endpoint_stays_on_one_line() -> None:
    with pytest.raises(auth.AuthConfigError) as exc:
        auth.require_auth_or_loopback(["tcp://0.0.0.0:1\nINFO fake log line"], auth_on=False)
    assert "\n" not in str(exc.value) and "'tcp://0.0.0.0:1\\nINFO fake log line'" in str(exc.value)


def _clean_env() -> dict[str, str]:
    """The caller's environment without any IBEX_ setting, so auth is off and ports are ours."""
    return {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}


@pytest.mark.parametrize("side", ["frontend", "backend"])
@pytest.mark.parametrize(("template", "phrase"), BYPASSES[:8])
def test_broker_refuses_to_start_and_binds_nothing(side: str, template: str, phrase: str) -> None:
    """A real broker given each bad form (frontend through the environment, backend through the
    flag) exits 2 with one line and leaves no port open; before the fix the first form started
    without auth, listening on the port after ';'."""
    p, q, good = free_port(), free_port(), free_port()
    bad = template.format(p=p, q=q)
    env = {**_clean_env(), "IBEX_BROKER_FRONTEND": bad if side == "frontend" else f"tcp://127.0.0.1:{good}"}
    args = [sys.executable, "-m", "ibex_context.broker"]
    args += ["--backend", bad] if side == "backend" else ["--backend", f"tcp://127.0.0.1:{good}"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        listening = [port for port in (p, q, good) if port_in_use("127.0.0.1", port)]
        proc.kill()
        proc.communicate()
        pytest.fail(f"broker started with {bad!r} and no auth; listening on {listening}")
    assert proc.returncode == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"broker: refusing to bind {bad} without authentication: ")
    assert phrase in lines[0] and out == ""
    assert not [port for port in (p, q, good) if port_in_use("127.0.0.1", port)]
