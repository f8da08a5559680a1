"""``up --redis-cluster N``: the launcher's plan runs the private cluster program instead of the one
server and gives every role the cluster's URL; without it the plan is the single server's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ibex_context.ops.roles import ROLES, HostPlan, plan_host
from ibex_context.shared.config.settings import Settings


def _host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: int) -> HostPlan:
    for name in ("IBEX_REDIS_URL", "IBEX_REDIS_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IBEX_REDIS_PORT", "23100")
    settings = Settings(redis_cluster=cluster)
    roles = frozenset(ROLES) - {"redis"}  # `up` alone: every role, a private Redis
    return plan_host(settings, tmp_path, roles=roles, split=False, name="h1", nonce_secret="n" * 64)


def _plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: int) -> dict[str, str]:
    return _host(tmp_path, monkeypatch, cluster).env


def test_a_cluster_replaces_the_private_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _plan(tmp_path, monkeypatch, 3)
    assert (env["IBEX_RUN_REDIS_CLUSTER"], env["IBEX_EMBEDDED_REDIS"]) == ("true", "false")
    assert env["IBEX_REDIS_CLUSTER"] == "3"
    assert env["IBEX_REDIS_URL"] == "redis+cluster://127.0.0.1:23100/0"


def test_without_it_the_private_server_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _plan(tmp_path, monkeypatch, 0)
    assert (env["IBEX_RUN_REDIS_CLUSTER"], env["IBEX_EMBEDDED_REDIS"]) == ("false", "true")
    assert env["IBEX_REDIS_URL"] == "redis://127.0.0.1:23100/0"


def test_the_cluster_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="redis_cluster"):
        Settings(redis_cluster=17)


def test_up_names_what_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _host(tmp_path, monkeypatch, 3).describe().startswith("redis cluster 3+3 (embedded), ")
    assert _host(tmp_path, monkeypatch, 0).describe().startswith("redis (embedded), ")
