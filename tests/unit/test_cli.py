"""`ibex-context` as a newcomer meets it: one-line errors with the right exit status, plain help,
hints, settings that do what the README says, and a `make up` stack that keeps its data.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ibex_context.memory.embedded_redis.server as redis_server
import ibex_context.ops.cli as cli
import ibex_context.ops.stack as stack
from ibex_context.shared.config.settings import Settings

# ------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("value", "expected"), [(None, 9464), ("0", 0), ("9999", 9999)])
def test_metrics_port_under_up(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int) -> None:
    if value is None:
        monkeypatch.delenv("IBEX_METRICS_PORT", raising=False)
    else:
        monkeypatch.setenv("IBEX_METRICS_PORT", value)
    settings = Settings()
    assert stack.metrics_port(settings) == expected
    assert stack._supervisor_env(settings)["IBEX_METRICS_PORT"] == str(expected)


def test_default_redis_url_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IBEX_REDIS_URL", raising=False)
    assert redis_server.default_redis_url(None, run_dir=tmp_path) == (None, "")
    redis_server.record_stack_redis_url("redis://127.0.0.1:7001/0", tmp_path)
    url, source = redis_server.default_redis_url(None, run_dir=tmp_path)
    assert url == "redis://127.0.0.1:7001/0" and "redis-url" in source
    monkeypatch.setenv("IBEX_REDIS_URL", "redis://127.0.0.1:7002/0")
    assert redis_server.default_redis_url(None, run_dir=tmp_path)[0] == "redis://127.0.0.1:7002/0"
    assert redis_server.default_redis_url("redis://127.0.0.1:7003/0", run_dir=tmp_path) == (
        "redis://127.0.0.1:7003/0", "--redis-url")
    redis_server.record_stack_redis_url(None, tmp_path)
    assert redis_server.stack_redis_url(tmp_path) is None


def test_cli_without_any_redis_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("IBEX_REDIS_URL", raising=False)
    monkeypatch.setattr(redis_server, "RUN_DIR", tmp_path / ".run")
    assert cli.main(["directive", "show", "--org", "acme", "--agent", "bot"]) == 2
    assert cli.main(["seed"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ibex-context directive show: no Redis") and "make up" in err[0]
    assert err[1].startswith("ibex-context seed: no Redis") and "IBEX_REDIS_URL" in err[1]
