"""The broker's no-auth guard: only endpoints no other host can reach are bound without CURVE.

ZeroMQ's ``tcp://source;bind`` form binds the part after ``;`` and names, interfaces and ``*``
are resolved at bind time, so each of those must be refused, both in the check and by a real
``python -m ibex_context.broker`` (docs/security.md "Authentication").

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_endpoint_guard.py.
"""

from __future__ import annotations

import pytest

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
