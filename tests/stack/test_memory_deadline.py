"""The caller's deadline on a memory-service read (memory.service.deadline): a call whose
``Ibex-Timeout-Ms`` has run out gets a 504 before any embedding or search starts, a malformed one a
400 naming the header, a queued query nobody waits for any more is not embedded, and the worker
sends its branch's time left, so the service skips the work of a branch the worker gave up on.
Against the real memory service (faults injected) and the real Redis.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import pytest

from ibex_context.memory.service.deadline import DeadlinePassed, Horizon
from ibex_context.memory.service.querybatch import QueryBatcher
from tests.helpers import eventually
from tests.stack.test_retrieval import ACME, _run, make  # noqa: F401  (make: the fixture, used by name)

SEARCH = {"query": "invoice billing fact", "agent_id": "bot", "limit": 5}


@pytest.fixture
def http(memory: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=memory.url, timeout=10.0) as client:
        yield client


def _dropped(http: httpx.Client) -> int:
    return int(http.get("/healthz").json()["deadline_dropped"])


def test_a_spent_deadline_is_answered_504_before_any_work(http: httpx.Client, memory: Any) -> None:
    memory.seed(ACME)
    h = memory.headers("acme")
    before = _dropped(http)
    r = http.post("/v1/memories/search", headers={**h, "Ibex-Timeout-Ms": "0"}, json=SEARCH)
    assert r.status_code == 504 and "Ibex-Timeout-Ms" in r.json()["error"], r.text
    r = http.get("/v1/memories/hot", headers={**h, "Ibex-Timeout-Ms": "0"},
                 params={"agent_id": "bot", "query": "invoice"})
    assert r.status_code == 504, r.text
    assert _dropped(http) == before + 2
    with_time = http.post("/v1/memories/search", headers={**h, "Ibex-Timeout-Ms": "5000"}, json=SEARCH)
    without = http.post("/v1/memories/search", headers=h, json=SEARCH)
    assert with_time.status_code == 200 and with_time.json() == without.json() and without.json()["memories"]
    assert _dropped(http) == before + 2


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1e309", "600001", "1" * 40, ""])
def test_a_malformed_timeout_is_a_400_naming_the_header(http: httpx.Client, memory: Any, value: str) -> None:
    r = http.post("/v1/memories/search", headers={**memory.headers("acme"), "Ibex-Timeout-Ms": value}, json=SEARCH)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "Ibex-Timeout-Ms" and "Ibex-Timeout-Ms" in r.json()["error"]


def test_a_call_delayed_past_its_deadline_does_no_search(http: httpx.Client, memory: Any) -> None:
    """The injected latency stands for a service too busy to start the call in time."""
    memory.seed(ACME)
    memory.set_fault("search", latency_ms=150)
    before = _dropped(http)
    r = http.post("/v1/memories/search", headers={**memory.headers("acme"), "Ibex-Timeout-Ms": "40"}, json=SEARCH)
    assert r.status_code == 504
    assert _dropped(http) == before + 1


async def test_the_worker_sends_its_branch_time_so_a_late_branch_costs_the_service_nothing(
        make: Any, memory: Any, http: httpx.Client) -> None:  # noqa: F811
    memory.set_fault("search", latency_ms=200)
    before = _dropped(http)
    resp = await _run(make(cold_timeout_ms=60))
    assert resp.branches["cold"].status == "timeout" and resp.branches["hot"].status == "success"
    # the service takes the call up after its injected latency, past the branch's time: no search
    await eventually("the service to drop the late search", lambda: _dropped(http) > before)
    assert _dropped(http) == before + 1, memory.log_tail()


async def test_queued_queries_whose_callers_left_are_not_embedded() -> None:
    """A query waiting behind a running batch is dropped when its deadline passes first; one
    without a deadline, or whose horizon a later caller extended, is still embedded."""
    seen: list[list[str]] = []
    started = threading.Event()

    def embed_many(texts: Sequence[str]) -> np.ndarray:
        seen.append(list(texts))
        started.set()
        time.sleep(0.15)
        return np.ones((len(texts), 4), dtype=np.float32)

    batcher = QueryBatcher(embed_many)
    first = asyncio.ensure_future(batcher.embed("first"))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
    soon = time.monotonic() + 0.03
    gone = asyncio.ensure_future(batcher.embed("gone", Horizon(soon)))
    extended = Horizon(soon)
    extended.extend(time.monotonic() + 5)
    kept = asyncio.ensure_future(batcher.embed("kept", extended))
    plain = asyncio.ensure_future(batcher.embed("plain"))
    await first
    with pytest.raises(DeadlinePassed):
        await gone
    assert (await kept).shape == (4,) and (await plain).shape == (4,)
    assert seen == [["first"], ["kept", "plain"]]
    assert batcher.dropped == 1 and batcher.queries == 3


def test_a_horizon_is_the_latest_deadline_and_none_means_someone_waits_without_one() -> None:
    h = Horizon(10.0)
    h.extend(5.0)
    assert h.at == 10.0 and h.passed(10.0) and not h.passed(9.9)
    h.extend(20.0)
    assert h.at == 20.0
    h.extend(None)
    assert h.at is None and not h.passed(1e18)
    h.extend(30.0)
    assert h.at is None
