"""The time kept back from the retrieval wall: measured, bounded, and quick to recover."""

from __future__ import annotations

from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.shared.config.settings import Settings
from ibex_context.worker.assemble import Assembler, StageCostTracker


def test_tracker_uses_initial_floor_until_warm_then_p95() -> None:
    t = StageCostTracker(initial_ms=3.0, window=128)
    for _ in range(10):
        t.observe(100_000)  # 0.1 ms, but too few samples to trust below the floor
    assert t.reserve_ns == 3_000_000
    for _ in range(200):
        t.observe(100_000)
    assert t.reserve_ns == 100_000


def test_tracker_recovers_after_a_burst() -> None:
    t = StageCostTracker(initial_ms=1.0, window=128)
    for _ in range(128):
        t.observe(50_000_000)  # an overload: 50 ms
    assert t.reserve_ns == 50_000_000
    for _ in range(128):
        t.observe(200_000)
    assert t.reserve_ns == 200_000  # one window later, the burst is forgotten


def test_reserve_is_capped() -> None:
    a = Assembler(settings=Settings(max_reply_reserve_ms=10), catalog=Catalog.load(), retriever=None)
    for _ in range(200):
        a.transit.observe(80_000_000)
    assert a.reserve_ns() == 10_000_000

