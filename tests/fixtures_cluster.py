"""A Redis Cluster from the bundled server (3 primaries, 3 replicas) as pytest fixtures. The
tests/stack/test_cluster_*.py modules point ``redis_url``, ``memory`` and ``stack`` at these to run
another module's tests on the cluster.

    redis_cluster       session   EmbeddedCluster: .url .nodes .primary_nodes .kill(node) .wait_ok()
    cluster_url         function  the session cluster's URL (``redis+cluster://``), every primary flushed
    cluster_memory      session   MemoryServiceHandle on the cluster
    cluster_memory_up   function  the same handle: running, faults cleared, the cluster flushed
    cluster_stack()     helper    a LocalStack on the cluster, the demo data seeded

One cluster per session, started only when a test asks for it. A test that kills a node starts a
cluster of its own (``memory.embedded_redis.cluster.EmbeddedCluster``), so this one stays whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster
from ibex_context.memory.embedded_redis.server import RedisStartError
from ibex_context.ops.stack import LocalStack
from tests.fixtures_services import MemoryServiceHandle, flush_redis, healed, running_memory_service
from tests.helpers import start_stack

SHM = "/dev/shm"
SHM_FREE_BYTES = 256 << 20  # room for the nodes' logs and a replica's full-sync file


def memory_dir() -> str | None:
    """A memory-backed directory for the nodes' files when the machine has one with room, else
    None (the temp dir). A node saves and fsyncs its ``nodes.conf`` at every change of its slots: on
    a disk a move of thousands of slots spends most of its time waiting on those fsyncs."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    return SHM if os.access(SHM, os.W_OK) and st.f_bavail * st.f_frsize >= SHM_FREE_BYTES else None


@contextlib.contextmanager
def started_cluster(primaries: int = 3, replicas: int = 1) -> Iterator[EmbeddedCluster]:
    """An embedded cluster for the ``with`` block; the test fails (never skips) if it cannot start."""
    cluster = EmbeddedCluster(primaries=primaries, replicas=replicas, root_dir=memory_dir())
    try:
        cluster.start()
    except RedisStartError as exc:
        pytest.fail(f"embedded Redis Cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    with started_cluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: EmbeddedCluster) -> str:
    redis_cluster.wait_ok()
    flush_redis(redis_cluster.url)
    return redis_cluster.url


@pytest.fixture(scope="session")
def cluster_memory(redis_cluster: EmbeddedCluster) -> Iterator[MemoryServiceHandle]:
    with running_memory_service(redis_cluster.url, "ibex-memsvc-cluster-") as handle:
        yield handle


@pytest.fixture
def cluster_memory_up(cluster_memory: MemoryServiceHandle, cluster_url: str) -> MemoryServiceHandle:
    """The cluster's memory service, running, with no faults and every primary flushed."""
    return healed(cluster_memory)


def cluster_stack(cluster: EmbeddedCluster, log_dir: Path, **kw: Any) -> LocalStack:
    """A LocalStack (broker, workers, memory service) on the cluster, the demo data seeded."""
    cluster.wait_ok()
    flush_redis(cluster.url)
    return start_stack(log_dir, redis_url=cluster.url, **kw)
