"""The stored-summary tests (tests/stack/test_summary_store.py: read with the directive in one
round trip, never across orgs, through a real stack) on the embedded Redis Cluster: the same test
functions, the memory service, the worker's slot-routed GET and the stack on the cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.ops.stack import LocalStack
from tests.fixtures_cluster import cluster_stack
from tests.fixtures_services import MemoryServiceHandle
from tests.stack.test_summary_store import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_summary_store import make as make

STACK_ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
             "IBEX_CONTEXT_DEADLINE_MS": "3000"}  # as tests/stack/test_summary_store.py's stack


@pytest.fixture
def memory(cluster_memory_up: MemoryServiceHandle) -> MemoryServiceHandle:
    return cluster_memory_up


@pytest.fixture(scope="module")
def stack(redis_cluster: EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = cluster_stack(redis_cluster, tmp_path_factory.mktemp("cluster-summaries"), workers=1, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()
