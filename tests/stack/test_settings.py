"""Settings: the spec's defaults, IBEX_* overrides, and refusal of nonsense.

Here: the checks through running servers; the pure parts are in
tests/unit/test_settings.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_ibex_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("IBEX_"):
            monkeypatch.delenv(var)


def test_memory_service_logs_json_when_asked(tmp_path: Path, redis_url: str) -> None:
    """The memory service uses the one logging setup: IBEX_LOG_FORMAT=json gives JSON lines, its
    own and uvicorn's (docs/deploy.md "Observability")."""
    log_path, port_file = tmp_path / "memory.log", tmp_path / "memory.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    # the hash embedder: minilm's start (it times both weight forms) says nothing of the logging
    env.update({"IBEX_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", "IBEX_MEMORY_EMBEDDER": "hash"})
    cmd = [sys.executable, "-m", "ibex_context.memory.service.server", "--port", "0", "--port-file", str(port_file),
           "--redis-url", redis_url]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "Application startup complete" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    lines = []
    for line in log_path.read_text().splitlines():
        if line.strip():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pytest.fail(f"a log line that is not JSON: {line!r}")
    started = [doc for doc in lines if doc["msg"].startswith("memory service on")]
    assert len(started) == 1 and started[0]["proc"] == "memory" and started[0]["level"] == "INFO"
    assert any(doc["logger"].startswith("uvicorn") for doc in lines)
