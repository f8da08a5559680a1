"""The directive store and CLI tests (tests/stack/test_directives.py) on the embedded Redis Cluster:
the same test functions, their ``redis_url`` naming the cluster (``redis+cluster://``)."""

from __future__ import annotations

import pytest

from tests.stack.test_directives import *  # noqa: F403  (the same tests, collected here again)
from tests.stack.test_directives import aredis as aredis


@pytest.fixture
def redis_url(cluster_url: str) -> str:
    return cluster_url
