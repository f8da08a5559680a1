"""The broker's no-auth guard: only endpoints no other host can reach are bound without CURVE.

ZeroMQ's ``tcp://source;bind`` form binds the part after ``;`` and names, interfaces and ``*``
are resolved at bind time, so each of those must be refused, both in the check and by a real
``python -m ibex_context.broker`` (docs/security.md "Authentication").

Here: the checks through running servers; the pure parts are in
tests/unit/test_endpoint_guard.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ibex_context.ops.stack import free_port, port_in_use
from tests.unit.test_endpoint_guard import BYPASSES


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
