"""The worker's retrieval tests (tests/stack/test_retrieval.py) on the embedded Redis Cluster: the
same test functions, with the memory service and the directive GET on the cluster."""

from __future__ import annotations

import pytest

from tests.fixtures_services import MemoryServiceHandle
from tests.stack.test_retrieval import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_retrieval import make as make

# Stopping the one server under the stack has no single-node counterpart here (tests/stack/
# test_cluster_failover.py kills a primary instead).
del test_redis_stopped_mid_run  # noqa: F821


@pytest.fixture
def memory(cluster_memory_up: MemoryServiceHandle) -> MemoryServiceHandle:
    return cluster_memory_up

