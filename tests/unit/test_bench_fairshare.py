"""``bench.fairshare``'s emulated memory service alone: one call at a time, orgs in turn, a call
refused at once when it would end past the wall. No process, no socket."""

from __future__ import annotations

import pytest

from bench.fairshare import MemoryService


def test_an_org_with_nothing_waiting_goes_next_then_orgs_take_turns() -> None:
    m = MemoryService(1000.0)  # a millisecond a call
    for k in range(4):
        assert m.call("flood", f"f{k}", 0.0)
    assert m.call("victim", "v0", 0.0) and m.call("victim", "v1", 0.0)
    done = m.done(1.0)
    assert [t for _, t in done] == ["f0", "v0", "f1", "v1", "f2", "f3"]  # f0 was under way
    assert [at for at, _ in done] == pytest.approx([0.001 * (k + 1) for k in range(6)])  # back to back
    assert m.next_s() is None and m.done(2.0) == []


def test_a_call_that_would_end_past_the_wall_is_refused_and_another_org_still_gets_in() -> None:
    m = MemoryService(100.0)  # 10 ms a call, a 45 ms wall
    assert [m.call("flood", k, 0.0) for k in range(6)] == [True] * 4 + [False] * 2  # the fifth: 50 ms
    assert m.call("victim", "v", 0.0)  # next after the call under way: done at 20 ms
    assert [t for _, t in m.done(0.025)] == [0, "v"]
    assert MemoryService(0.0).call("x", 1, 0.0)  # no memory service: nothing to refuse
