"""The calibration tests (tests/stack/test_calibration.py: the sketch store's Lua with the org's
storage ledger, poisoned reports kept to their org, the CLI) on the embedded Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.ops.stack import LocalStack
from tests.fixtures_cluster import cluster_stack
from tests.stack.test_calibration import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_calibration import STACK_ENV


@pytest.fixture
def redis_url(cluster_url: str) -> str:
    return cluster_url


@pytest.fixture(scope="module")
def stack(redis_cluster: EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = cluster_stack(redis_cluster, tmp_path_factory.mktemp("cluster-calibration"), workers=2, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()
