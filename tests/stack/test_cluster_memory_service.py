"""The memory service's tests (tests/stack/test_memory_service.py: writes, hot memories, search,
seeding, isolation) on the embedded Redis Cluster: the same test functions, the service on the
cluster."""

from __future__ import annotations

import pytest

from tests.fixtures_services import MemoryServiceHandle
from tests.stack.test_memory_service import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_memory_service import http as http

# Stopping the one server has no single-node counterpart here (tests/stack/test_cluster_failover.py
# kills a primary instead).
del test_redis_outage_is_503_then_recovers  # noqa: F821


@pytest.fixture
def memory(cluster_memory_up: MemoryServiceHandle) -> MemoryServiceHandle:
    return cluster_memory_up


@pytest.fixture
def redis_url(cluster_url: str) -> str:
    return cluster_url
