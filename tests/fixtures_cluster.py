"""A Redis Cluster from the bundled server (3 primaries, 3 replicas) as pytest fixtures, and the
backend fixtures that run one test on both the single server and the cluster.

    redis_cluster       session   EmbeddedCluster: .url .nodes .primary_nodes .kill(node) .wait_ok()
    cluster_url         function  the session cluster's URL (``redis+cluster://``), every primary flushed
    cluster_memory      session   MemoryServiceHandle on the cluster
    cluster_memory_up   function  the same handle: running, faults cleared, the cluster flushed
    backend_url         function  params single|cluster: a flushed Redis URL of either kind
    backend_memory      function  params single|cluster: a running memory service on either, flushed

One cluster per session, started only when a test asks for it. A test that kills a node starts a
cluster of its own (``memory.redis_cluster.EmbeddedCluster``), so this one stays whole.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ibex_context.memory.redis_cluster import EmbeddedCluster
from ibex_context.memory.redis_server import RedisStartError
from ibex_context.ops.stack import LocalStack
from tests.fixtures_services import MemoryServiceHandle, ServiceStartError, flush_redis
from tests.helpers import start_stack

BACKENDS = ("single", "cluster")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(primaries=3, replicas=1)
    try:
        cluster.start()
    except RedisStartError as exc:
        pytest.fail(f"embedded Redis Cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: EmbeddedCluster) -> str:
    redis_cluster.wait_ok()
    flush_redis(redis_cluster.url)
    return redis_cluster.url


@pytest.fixture(scope="session")
def cluster_memory(redis_cluster: EmbeddedCluster) -> Iterator[MemoryServiceHandle]:
    workdir = Path(tempfile.mkdtemp(prefix="ibex-memsvc-cluster-"))
    handle = MemoryServiceHandle(redis_url=redis_cluster.url, workdir=workdir)
    try:
        handle.start()
    except ServiceStartError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield handle
    finally:
        handle.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def cluster_memory_up(cluster_memory: MemoryServiceHandle, cluster_url: str) -> MemoryServiceHandle:
    """The cluster's memory service, running, with no faults and every primary flushed."""
    if not cluster_memory.running:  # an earlier test stopped or killed it
        try:
            cluster_memory.start()
        except ServiceStartError as exc:
            pytest.fail(str(exc), pytrace=False)
    cluster_memory.clear_faults()
    return cluster_memory


def cluster_stack(cluster: EmbeddedCluster, log_dir: Path, **kw: Any) -> LocalStack:
    """A LocalStack (broker, workers, memory service) on the cluster, the demo data seeded."""
    cluster.wait_ok()
    flush_redis(cluster.url)
    return start_stack(log_dir, redis_url=cluster.url, **kw)


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> str:
    """A flushed Redis of each kind: the same test runs on one server and on the cluster."""
    url: str = request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url")
    return url


@pytest.fixture(params=BACKENDS)
def backend_memory(request: pytest.FixtureRequest) -> MemoryServiceHandle:
    """The memory service of each kind, running, no faults, its Redis flushed."""
    if request.param == "single":
        handle: MemoryServiceHandle = request.getfixturevalue("memory")
        return handle
    handle = request.getfixturevalue("cluster_memory_up")
    return handle
