"""The summary operation's tests (tests/stack/test_summary_op.py: stored only when it covers more,
read back by an assembly, written as a memory) through a real stack on the embedded Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.ops.stack import LocalStack
from tests.fixtures_cluster import cluster_stack
from tests.stack.test_summary_op import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_summary_op import ENV


@pytest.fixture(scope="module")
def stack(redis_cluster: EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = cluster_stack(redis_cluster, tmp_path_factory.mktemp("cluster-summary-op"), workers=1, env=ENV)
    try:
        s.wait_workers(1)
        yield s
    finally:
        s.stop()
