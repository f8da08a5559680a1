"""Settings: the spec's defaults, IBEX_* overrides, and refusal of nonsense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from ibex_context.shared.settings import Settings, usable_cpus


def test_spec_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(__import__("os").environ):
        if var.startswith("IBEX_"):
            monkeypatch.delenv(var)
    s = Settings()
    assert (s.context_timeout_ms, s.context_deadline_ms) == (45.0, 40.0)
    assert s.retrieval_wall_ms == 40.0  # min(45, 40)
    # hot 45 (was 15): the hot call carries the question, embedded by the memory service (issue 19)
    assert (s.directive_timeout_ms, s.hot_timeout_ms, s.cold_timeout_ms) == (5.0, 45.0, 45.0)
    assert (s.hot_limit, s.cold_limit) == (20, 50)
    assert s.redis_url is None  # embedded Redis
    assert s.workers == usable_cpus()
    assert s.endpoints() == ["tcp://127.0.0.1:5555"] and s.backends() == [s.broker_backend]


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_CONTEXT_TIMEOUT", "30")
    monkeypatch.setenv("IBEX_CONTEXT_DEADLINE_MS", "60")
    monkeypatch.setenv("IBEX_BROKER_ENDPOINTS", "tcp://a:1, tcp://b:2")
    monkeypatch.setenv("IBEX_WORKERS", "3")
    s = Settings()
    assert s.retrieval_wall_ms == 30.0
    assert s.endpoints() == ["tcp://a:1", "tcp://b:2"]
    assert s.workers == 3


@pytest.mark.parametrize(("var", "value"), [("IBEX_HOT_LIMIT", "21"), ("IBEX_CONTEXT_TIMEOUT", "-1"),
                                            ("IBEX_WORKERS", "0"), ("IBEX_LOG_LEVEL", "LOUD"),
                                            ("IBEX_QUEUE_MAX", "lots")])
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        Settings()


def test_every_setting_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")
    names = {"context_timeout_ms": "IBEX_CONTEXT_TIMEOUT"}
    for field in Settings.model_fields:
        var = names.get(field, f"IBEX_{field.upper()}")
        assert var in readme, f"{var} is not documented in README.md"


def test_memory_service_logs_json_when_asked(tmp_path: Path, redis_url: str) -> None:
    """The memory service uses the one logging setup: IBEX_LOG_FORMAT=json gives JSON lines, its
    own and uvicorn's (README: Observability)."""
    log_path, port_file = tmp_path / "memory.log", tmp_path / "memory.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update({"IBEX_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "ibex_context.memory.server", "--port", "0", "--port-file", str(port_file),
           "--redis-url", redis_url]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while "Application startup complete" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    started = [doc for doc in lines if doc["msg"].startswith("memory service on")]
    assert len(started) == 1 and started[0]["proc"] == "memory" and started[0]["level"] == "INFO"
    assert any(doc["logger"].startswith("uvicorn") for doc in lines)
