"""Stack tests: each one's leaks are reported in that test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_after_each_test() -> Iterator[None]:
    """A socket or file a test leaves open inside a reference cycle is finalised, and warns (an
    error in this suite), whenever the collector next runs: in some later test, often a unit test
    on the same process. Collecting when each test's own fixtures are gone reports it here."""
    yield
    gc.collect()
