"""Settings: the spec's defaults, IBEX_* overrides, and refusal of nonsense.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_settings.py.
"""

from __future__ import annotations

import warnings

import pytest
from pydantic import ValidationError

from ibex_context.memory.service.config import MemoryConfig
from ibex_context.shared.config.settings import (
    BrokerSettings,
    ClientSettings,
    MemoryServiceSettings,
    PipelineSettings,
    Settings,
    WorkerSettings,
    usable_cpus,
)


def test_spec_defaults() -> None:
    s = Settings()
    assert (s.client_timeout_ms, s.retrieval_timeout_ms, s.context_deadline_ms) == (45.0, 45.0, 40.0)
    assert s.retrieval_wall_ms == 40.0  # min(45, 40)
    # hot 45: the hot call carries the question, embedded by the memory service
    assert (s.directive_timeout_ms, s.hot_timeout_ms, s.cold_timeout_ms) == (5.0, 45.0, 45.0)
    assert (s.hot_limit, s.cold_limit) == (20, 40)
    assert s.redis_url is None  # embedded Redis
    assert s.workers == usable_cpus()
    assert s.endpoints() == ["tcp://127.0.0.1:5555"] and s.backends() == [s.broker_backend]


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_RETRIEVAL_TIMEOUT_MS", "30")
    monkeypatch.setenv("IBEX_CONTEXT_DEADLINE_MS", "60")
    monkeypatch.setenv("IBEX_BROKER_ENDPOINTS", "tcp://a:1, tcp://b:2")
    monkeypatch.setenv("IBEX_WORKERS", "3")
    s = Settings()
    assert s.retrieval_wall_ms == 30.0 and s.client_timeout_ms == 45.0
    assert s.endpoints() == ["tcp://a:1", "tcp://b:2"]
    assert s.workers == 3


@pytest.mark.parametrize(("var", "value"), [("IBEX_HOT_LIMIT", "21"), ("IBEX_CLIENT_TIMEOUT_MS", "-1"),
                                            ("IBEX_RETRIEVAL_TIMEOUT_MS", "0"), ("IBEX_WORKERS", "0"),
                                            ("IBEX_LOG_LEVEL", "LOUD"), ("IBEX_LOG_FORMAT", "xml"),
                                            ("IBEX_QUEUE_MAX", "lots"), ("IBEX_MEMORY_PORT", "70000")])
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        Settings()


# Each role's class reads only its own variables: a value that would be refused by the role that
# reads it is ignored by every other role (a worker host may hold a client's malformed setting, and
# the other way round, and both still start). The root's (log level and format) are every role's.
ROLES = {"broker": BrokerSettings, "worker": WorkerSettings, "client": ClientSettings, "memory": MemoryConfig}
OWN_BAD_VALUE = [("IBEX_CLIENT_TIMEOUT_MS", "soon", {"client"}), ("IBEX_LITELLM_KEYS", "", set()),
                 ("IBEX_HOT_LIMIT", "21", {"worker"}), ("IBEX_RETRIEVAL_TIMEOUT_MS", "-1", {"worker"}),
                 ("IBEX_QUEUE_MAX", "lots", {"broker"}), ("IBEX_MEMORY_MAX_CANDIDATES", "0", {"memory"}),
                 ("IBEX_MEMORY_EMBEDDER", "word2vec", {"memory"}), ("IBEX_MEMORY_URL", "x" * 0, set()),
                 ("IBEX_MAX_REPLY_BYTES", "1", {"broker", "worker"}),
                 ("IBEX_RESPONSE_RESERVE_FRACTION", "2", {"worker", "client"}),
                 ("IBEX_REDIS_URL", "", set()), ("IBEX_LOG_LEVEL", "LOUD", set(ROLES))]


@pytest.mark.parametrize(("var", "value", "readers"), OWN_BAD_VALUE)
def test_each_role_reads_only_its_own_variables(monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                                                readers: set[str]) -> None:
    monkeypatch.setenv(var, value)
    refused = set()
    for role, cls in ROLES.items():
        try:
            cls()
        except ValidationError:
            refused.add(role)
    assert refused == readers


def test_the_client_loads_no_server_settings() -> None:
    """The client library's class holds the pipeline policy its degraded reply needs, and nothing of
    the worker's retrieval, the broker or the memory service (their secrets included)."""
    fields = set(ClientSettings.model_fields)
    assert set(PipelineSettings.model_fields) <= fields
    assert not fields & {"memory_secret", "memory_url", "redis_url", "retrieval_timeout_ms", "hot_limit",
                         "auth_keys_file", "broker_key_file", "worker_key_file", "queue_max", "memory_host"}
    assert not set(WorkerSettings.model_fields) & {"client_timeout_ms", "client_key_file", "litellm_config"}


def test_the_client_s_nonce_key_never_uses_a_memory_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_MEMORY_SECRET", "a-private-memory-secret")
    assert ClientSettings().nonce_inputs() == (None, Settings.model_fields["memory_secret"].default)
    assert WorkerSettings().nonce_inputs() == (None, "a-private-memory-secret")
    monkeypatch.setenv("IBEX_NONCE_SECRET", "a-nonce-secret")
    assert ClientSettings().nonce_inputs()[0] == WorkerSettings().nonce_inputs()[0] == "a-nonce-secret"


@pytest.mark.parametrize("old", ["IBEX_CONTEXT_TIMEOUT", "IBEX_CONTEXT_TIMEOUT_MS"])
def test_the_old_timeout_sets_both_new_ones_with_one_deprecation_warning(monkeypatch: pytest.MonkeyPatch,
                                                                          old: str) -> None:
    monkeypatch.setenv(old, "300")
    with pytest.warns(DeprecationWarning, match="IBEX_CLIENT_TIMEOUT_MS") as caught:
        s = Settings()
    assert len(caught) == 1  # once per load, although two fields take it
    assert (s.client_timeout_ms, s.retrieval_timeout_ms, s.retrieval_wall_ms) == (300.0, 300.0, 40.0)
    with pytest.warns(DeprecationWarning):
        assert ClientSettings().client_timeout_ms == 300.0
    with pytest.warns(DeprecationWarning):
        assert WorkerSettings().retrieval_timeout_ms == 300.0
    monkeypatch.setenv("IBEX_CLIENT_TIMEOUT_MS", "70")  # a new name wins over the old one
    with pytest.warns(DeprecationWarning):
        s = Settings()
    assert (s.client_timeout_ms, s.retrieval_timeout_ms) == (70.0, 300.0)
    with pytest.warns(DeprecationWarning):
        assert Settings(context_timeout_ms=25).retrieval_timeout_ms == 25.0  # the old field name too
    monkeypatch.setenv(old, "-1")
    with pytest.raises(ValidationError), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        WorkerSettings()


def test_no_warning_without_the_old_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_CLIENT_TIMEOUT_MS", "80")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Settings().client_timeout_ms == 80.0 and ClientSettings().client_timeout_ms == 80.0


def test_the_memory_service_reads_its_settings_through_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryConfig is the tree's memory-service part: the root's log settings, the Redis URL, host,
    port and embedder are the names every role uses, its own limits IBEX_MEMORY_*."""
    monkeypatch.setenv("IBEX_LOG_FORMAT", "json")
    monkeypatch.setenv("IBEX_LOG_LEVEL", "debug")
    monkeypatch.setenv("IBEX_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("IBEX_MEMORY_PORT", "9000")
    monkeypatch.setenv("IBEX_MEMORY_EMBEDDER", "hash")
    monkeypatch.setenv("IBEX_MEMORY_MAX_CANDIDATES", "77")
    monkeypatch.setenv("IBEX_MEMORY_SECRET", "a-private-memory-secret")
    config = MemoryConfig()
    assert isinstance(config, MemoryServiceSettings)
    assert (config.log_format, config.log_level, config.redis_url) == ("json", "DEBUG", "redis://127.0.0.1:1/0")
    assert (config.memory_port, config.embedder, config.max_candidates) == (9000, "hash", 77)
    assert config.secret == WorkerSettings().memory_secret and not config.uses_dev_secret
    ops = Settings()  # the launcher sees where the service listens and what it embeds with
    assert (ops.memory_port, ops.embedder, ops.redis_url) == (9000, "hash", "redis://127.0.0.1:1/0")
    assert MemoryConfig(embedder="static", relevance_floor=0.2).embedder == "static"  # field names as arguments
