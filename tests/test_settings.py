"""Settings: the spec's defaults, IBEX_* overrides, and refusal of nonsense."""

from __future__ import annotations

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
    assert (s.directive_timeout_ms, s.hot_timeout_ms, s.cold_timeout_ms) == (5.0, 15.0, 45.0)
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
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")
    names = {"context_timeout_ms": "IBEX_CONTEXT_TIMEOUT"}
    for field in Settings.model_fields:
        var = names.get(field, f"IBEX_{field.upper()}")
        assert var in readme, f"{var} is not documented in README.md"
