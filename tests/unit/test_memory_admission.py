"""Admission at the memory service: the query batcher's fair order and its refusal of work that
would end after its caller's deadline (memory.service.querybatch), and the worker's adaptive limit on
assemblies calling the memory service (worker.memgate)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.memory.service.deadline import Horizon
from ibex_context.memory.service.querybatch import QueryBatcher, WouldMissDeadline
from ibex_context.shared.wire.models import BranchOutcome
from ibex_context.worker.memgate import AT_CAPACITY, MIN_LIMIT, RECOVER_NS, MemoryGate, memory_outcome
from tests.properties import examples

Queued = list[tuple[str, "asyncio.Future[np.ndarray]"]]


class Blocked:
    """An ``embed_many`` whose first batch waits until released; records every batch."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(list(texts))
        self.started.set()
        self.release.wait(10)
        return np.ones((len(texts), 4), dtype=np.float32)


async def _running(batcher: QueryBatcher, embed: Blocked) -> asyncio.Future[np.ndarray]:
    """A first query of org ``c``, being embedded (the batcher busy) when this returns."""
    first = asyncio.ensure_future(batcher.embed("first", None, "c"))
    await asyncio.get_running_loop().run_in_executor(None, embed.started.wait, 10)
    return first


def _queue(batcher: QueryBatcher, org: str, n: int, horizon: Horizon | None = None) -> Queued:
    return [(f"{org}{i}", asyncio.ensure_future(batcher.embed(f"{org}{i}", horizon, org))) for i in range(n)]


async def test_orgs_with_questions_waiting_share_the_batches_and_an_org_alone_uses_them() -> None:
    embed = Blocked()
    batcher = QueryBatcher(embed, max_batch=4)
    first = await _running(batcher, embed)
    queued = _queue(batcher, "a", 6) + _queue(batcher, "b", 2)
    await asyncio.sleep(0)
    embed.release.set()
    await asyncio.gather(first, *(fut for _, fut in queued))
    # b sent two while a sent six: b's two go in the first batch beside a's first two.
    assert embed.batches == [["first"], ["a0", "b0", "a1", "b1"], ["a2", "a3", "a4", "a5"]]


async def test_a_heavier_org_gets_its_weight_of_each_batch() -> None:
    embed = Blocked()
    batcher = QueryBatcher(embed, max_batch=3, weights={"a": 2.0})
    first = await _running(batcher, embed)
    queued = _queue(batcher, "a", 4) + _queue(batcher, "b", 4)
    await asyncio.sleep(0)
    embed.release.set()
    await asyncio.gather(first, *(fut for _, fut in queued))
    assert [sum(t.startswith("a") for t in b) for b in embed.batches[1:3]] == [2, 2]


async def test_a_query_that_would_end_after_its_deadline_is_refused_at_once_over_share_first() -> None:
    """With a measured batch time, a query whose batch would end after its caller's deadline is
    refused on arrival; the org with many queued ahead of its query is the one refused."""
    embed = Blocked()
    batcher = QueryBatcher(embed, max_batch=1)
    first = await _running(batcher, embed)
    batcher.urgent.batch_s = 1.0  # as if measured: one batch a second
    flood = _queue(batcher, "a", 5)
    await asyncio.sleep(0)  # the flood's calls are queued
    soon = Horizon(time.monotonic() + 3.0)  # a's sixth would wait for five batches: refused
    with pytest.raises(WouldMissDeadline) as refused:
        await batcher.embed("a-late", soon, "a")
    assert refused.value.status == 503 and "at capacity" in refused.value.message
    victim = asyncio.ensure_future(batcher.embed("b0", soon, "b"))  # b has nothing queued: next batch
    no_deadline = asyncio.ensure_future(batcher.embed("a-patient", None, "a"))
    await asyncio.sleep(0)
    assert batcher.refused == 1 and not victim.done()
    embed.release.set()
    await asyncio.gather(first, victim, no_deadline, *(fut for _, fut in flood))
    assert embed.batches[1] == ["a0"] and embed.batches[2] == ["b0"] and batcher.queries == 8


async def test_the_time_a_call_needs_after_its_vector_counts_against_its_deadline() -> None:
    """A query whose embedding would end in time but leave too little for the search after it
    (``note_after``) is refused on arrival too."""
    embed = Blocked()
    batcher = QueryBatcher(embed, max_batch=1)
    first = await _running(batcher, embed)
    batcher.urgent.batch_s = 1.0
    horizon = Horizon(time.monotonic() + 2.5)  # the running batch's rest, then its own: ends in time
    fits = asyncio.ensure_future(batcher.embed("fits", horizon, "a"))
    await asyncio.sleep(0)
    batcher.note_after(2.0)  # ... but the searches after their vectors take two seconds
    with pytest.raises(WouldMissDeadline):
        await batcher.embed("late", Horizon(time.monotonic() + 3.5), "b")
    assert batcher.after_s == 2.0 and batcher.refused == 1
    embed.release.set()
    await asyncio.gather(first, fits)


async def test_a_batch_takes_no_more_questions_than_fit_in_its_target_time() -> None:
    """With a batch time target, a slow forward pass means batches of one; without, the queue
    goes in one batch."""
    for target, sizes in ((0.25, [1, 1, 1, 1, 1, 1]), (None, [1, 5])):
        embed = Blocked()
        batcher = QueryBatcher(embed, max_batch=8, batch_target_s=target)
        first = await _running(batcher, embed)
        batcher.urgent.query_s = 10.0  # as if measured: 10 s a question, so none fits with another in 0.25 s
        queued = _queue(batcher, "c", 5)  # the running question's org: alone, on the one lane
        await asyncio.sleep(0)
        embed.release.set()
        await asyncio.gather(first, *(fut for _, fut in queued))
        assert [len(b) for b in embed.batches] == sizes
        assert 0 < batcher.urgent.query_s < 10.0  # each batch's time per question was measured in


def test_the_batch_cap_is_the_questions_that_fit_at_the_measured_pace() -> None:
    batcher: QueryBatcher[np.ndarray] = QueryBatcher(Blocked(), max_batch=8, batch_target_s=0.025)
    assert batcher.batch_cap() == 8  # nothing measured yet: the first question runs alone anyway
    for per, cap in ((0.009, 2), (0.012, 2), (0.03, 1), (0.001, 8)):
        batcher.urgent.query_s = per
        assert batcher.batch_cap() == cap


async def test_nothing_is_refused_before_a_batch_time_is_measured() -> None:
    embed = Blocked()
    batcher = QueryBatcher(embed, max_batch=2)
    first = await _running(batcher, embed)
    queued = _queue(batcher, "a", 5, Horizon(time.monotonic() + 60))
    embed.release.set()
    await asyncio.gather(first, *(fut for _, fut in queued))
    assert batcher.refused == 0 and batcher.urgent.batch_s > 0


class PerLane:
    """An ``embed_many`` that records each batch with its lane and the thread's nice value, and
    holds the bulk lane's batches until ``release_bulk`` is set."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[str], int]] = []
        self.release_bulk = threading.Event()
        self.urgent_started = threading.Event()
        self.urgent_release = threading.Event()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        lane = "bulk" if threading.current_thread().name.startswith("query-bulk") else "urgent"
        self.batches.append((lane, list(texts), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if lane == "bulk":
            self.release_bulk.wait(10)
        else:
            self.urgent_started.set()
            self.urgent_release.wait(10)
        return np.ones((len(texts), 4), dtype=np.float32)


async def test_an_org_over_its_share_yields_the_urgent_lane_to_a_light_org() -> None:
    """While b has a question in, a's questions past half its share of the embedding go on the bulk lane
    (a thread at ``bulk_nice``); b's next question is embedded on the urgent lane while a's batch is
    still held on the bulk one."""
    embed = PerLane()
    batcher = QueryBatcher(embed, max_batch=8, bulk_nice=7)
    b0 = asyncio.ensure_future(batcher.embed("b0", None, "b"))
    await asyncio.get_running_loop().run_in_executor(None, embed.urgent_started.wait, 10)
    batcher.urgent.query_s = 0.2  # as if measured: a question takes 0.2 s of a lane
    flood = _queue(batcher, "a", 5)  # a0 before a is active; a1 at 0.2 of a lane; a2.. over half its half
    await asyncio.sleep(0)
    assert [len(batcher.urgent.pending), len(batcher.bulk.pending) + batcher.bulk.queries] == [2, 3]
    embed.urgent_release.set()
    await b0
    b1 = await batcher.embed("b1", None, "b")  # a's bulk batch is still held
    assert b1.shape == (4,) and not any(f.done() for _, f in flood[2:])
    embed.release_bulk.set()
    await asyncio.gather(*(f for _, f in flood))
    lanes = [(lane, texts) for lane, texts, _ in embed.batches]
    assert lanes == [("urgent", ["b0"]), ("bulk", ["a2", "a3", "a4"]), ("urgent", ["a0", "a1"]), ("urgent", ["b1"])]
    if sys.platform.startswith("linux"):
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert {lane: nice for lane, _, nice in embed.batches} == {"urgent": base, "bulk": max(7, base)}
    assert batcher.bulk.queries == 3 and batcher.queries == 7


async def test_an_org_alone_is_never_sent_to_the_bulk_lane() -> None:
    embed = PerLane()
    embed.urgent_release.set()
    batcher = QueryBatcher(embed, max_batch=2)
    batcher.urgent.query_s = 10.0  # as if measured: any queue is far over a share
    queued = _queue(batcher, "a", 6)
    await asyncio.gather(*(f for _, f in queued))
    assert batcher.bulk.queries == 0 and {lane for lane, _, _ in embed.batches} == {"urgent"}


# ---------------------------------------------------------------------------- worker.memgate


def test_at_the_floor_two_orgs_get_a_slot_each() -> None:
    gate = MemoryGate(4, limit=MIN_LIMIT)
    gate.seen_ns["b"] = 0
    assert gate.try_enter("a", 1) and not gate.try_enter("a", 2)
    assert gate.try_enter("b", 3) and not gate.try_enter("b", 4)


def test_an_org_alone_may_hold_every_slot() -> None:
    gate = MemoryGate(4)
    assert all(gate.try_enter("a", 0) for _ in range(4))
    assert not gate.try_enter("a", 0) and gate.refused == 1


def test_a_flood_never_takes_the_slot_of_another_org_seen_lately() -> None:
    gate = MemoryGate(4)
    assert gate.try_enter("b", 0)
    gate.leave("b", overloaded=False, succeeded=True, binding=False, now_ns=1, took_ns=1)
    took = [gate.try_enter("a", 10) for _ in range(4)]
    assert took == [True, True, True, False]  # the last slot is kept for b
    assert gate.try_enter("b", 20)
    # once b has not been seen for a while, a may use every slot again
    gate.leave("b", overloaded=False, succeeded=True, binding=False, now_ns=30, took_ns=1)
    assert gate.try_enter("a", 5_000_000_000)


def test_overload_cuts_the_limit_once_per_call_time_and_clean_binding_replies_raise_it() -> None:
    gate = MemoryGate(4)
    for now in (1_000, 1_001, 1_002):  # one burst of late answers: one cut
        gate.try_enter("a", now)
        gate.leave("a", overloaded=True, succeeded=False, binding=False, now_ns=now, took_ns=500)
    assert gate.limit == 3.0 and gate.cuts == 1 and gate.slots == 3
    for now in range(10_000, 20_000, 1_000):  # a slow service: down to the floor, no lower
        gate.try_enter("a", now)
        gate.leave("a", overloaded=True, succeeded=False, binding=False, now_ns=now, took_ns=500)
    assert gate.limit == MIN_LIMIT
    assert gate.try_enter("a", 19_500) and gate.limit == MIN_LIMIT  # not quiet for long yet
    gate.leave("a", overloaded=False, succeeded=True, binding=False, now_ns=19_600, took_ns=100)
    assert gate.try_enter("a", 19_000 + RECOVER_NS) and gate.limit == 4.0  # quiet since: the cap again
    gate.leave("a", overloaded=False, succeeded=True, binding=False, now_ns=19_100 + RECOVER_NS, took_ns=100)
    gate.limit, gate.last_cut_ns = 3.0, 3_000_000_000
    gate.try_enter("a", 2_000)
    gate.leave("a", overloaded=False, succeeded=True, binding=False, now_ns=2_000, took_ns=500)
    assert gate.limit == 3.0  # a limit that was not binding has not shown it could be higher
    gate.try_enter("a", 3_000)
    gate.leave("a", overloaded=False, succeeded=True, binding=True, now_ns=3_000, took_ns=500)
    assert gate.limit == pytest.approx(3.0 + 1 / 3)


@settings(max_examples=examples(100))
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.booleans()), max_size=60))
def test_the_limit_stays_between_its_floor_and_the_cap_and_slots_are_given_back(
        steps: list[tuple[str, bool, bool]]) -> None:
    gate = MemoryGate(4)
    held: list[str] = []
    for i, (org, leave, overloaded) in enumerate(steps):
        now = i * 1_000
        if leave and held:
            gate.leave(held.pop(0), overloaded=overloaded, succeeded=not overloaded, binding=True, now_ns=now,
                       took_ns=10)
        elif gate.try_enter(org, now):
            held.append(org)
        assert MIN_LIMIT <= gate.limit <= 4 and gate.total == len(held) <= 4
        assert sum(gate.inflight.values()) == gate.total


def test_the_outcome_of_a_replys_memory_calls() -> None:
    ok = BranchOutcome(status="success", elapsed_ms=1.0)
    late = BranchOutcome(status="timeout", elapsed_ms=45.0, error_class="TimeoutError")
    refused = BranchOutcome(status="error", elapsed_ms=0.5, error_class="HTTP 503")
    broken = BranchOutcome(status="error", elapsed_ms=0.5, error_class="MalformedResponse")
    off = BranchOutcome(status="skipped", elapsed_ms=0.0)
    assert memory_outcome({"directive": late, "hot": ok, "cold": ok}) == (False, True)
    assert memory_outcome({"hot": ok, "cold": late}) == (True, False)
    assert memory_outcome({"hot": refused, "cold": off}) == (True, False)
    assert memory_outcome({"hot": broken, "cold": ok}) == (False, False)
    not_called = BranchOutcome(status="error", elapsed_ms=0.0, error_class=AT_CAPACITY)
    assert memory_outcome({"hot": not_called, "cold": not_called}) == (True, False)
