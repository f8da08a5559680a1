"""The memory service's searches in flight, shared by orgs in fair order (memory.service.fair_slots)."""

from __future__ import annotations

import asyncio
import time

import pytest

from ibex_context.memory.service.deadline import DeadlinePassed
from ibex_context.memory.service.fair_slots import MIN_HOLDS, AtCapacity, FairSlots


class Calls:
    """Calls that enter ``slots`` and stay inside until released one by one; records who got in."""

    def __init__(self, slots: FairSlots) -> None:
        self.slots = slots
        self.entered: list[str] = []
        self._gates: dict[int, asyncio.Event] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, org: str, deadline: float | None = None) -> int:
        i = len(self.tasks)
        gate = self._gates[i] = asyncio.Event()

        async def call() -> None:
            async with self.slots.hold(org, deadline):
                self.entered.append(f"{org}{i}")
                await gate.wait()

        self.tasks.append(asyncio.ensure_future(call()))
        return i

    async def release(self, i: int) -> None:
        self._gates[i].set()
        await self.tasks[i]
        await asyncio.sleep(0)  # the granted call runs its first step


async def test_an_org_alone_uses_every_slot_and_the_rest_of_its_calls_wait() -> None:
    calls = Calls(FairSlots(3, 4))
    ids = [calls.start("a") for _ in range(5)]
    await asyncio.sleep(0)
    assert calls.entered == ["a0", "a1", "a2"] and calls.slots.busy == 3 and calls.slots.waited == 2
    await calls.release(ids[0])
    assert calls.entered[-1] == "a3"
    for i in ids[1:]:
        await calls.release(i)
    assert calls.slots.busy == 0 and calls.slots.held("a") == 0


async def test_an_org_over_its_cap_waits_while_another_org_takes_a_free_slot() -> None:
    calls = Calls(FairSlots(5, 2))
    for _ in range(3):
        calls.start("a")
    calls.start("b")
    await asyncio.sleep(0)
    assert calls.entered == ["a0", "a1", "b3"] and calls.slots.held("a") == 2
    await calls.release(0)
    assert calls.entered[-1] == "a2"


async def test_a_freed_slot_goes_to_the_org_with_the_fewest_in_flight_not_the_longest_queue() -> None:
    calls = Calls(FairSlots(2, 4))
    calls.start("a"), calls.start("a")
    flood = [calls.start("a") for _ in range(4)]
    victim = calls.start("b")  # queued behind four of a's
    await asyncio.sleep(0)
    await calls.release(0)
    assert calls.entered[-1] == f"b{victim}"  # b holds none, a one: b goes first
    await calls.release(1)
    assert calls.entered[-1] == f"a{flood[0]}"  # then a's queue, oldest first


async def test_weights_share_the_slots() -> None:
    calls = Calls(FairSlots(3, 3, {"a": 2.0}))
    first = [calls.start("c") for _ in range(3)]  # every slot busy
    for _ in range(4):
        calls.start("b"), calls.start("a")  # b queued first: with equal weights b would end with two
    await asyncio.sleep(0)
    for i in first:
        await calls.release(i)
    assert calls.slots.held("a") == 2 and calls.slots.held("b") == 1


async def test_a_call_still_waiting_at_its_deadline_is_refused_and_leaks_no_slot() -> None:
    slots = FairSlots(1, 1)
    calls = Calls(slots)
    holder = calls.start("a")
    await asyncio.sleep(0)
    with pytest.raises(DeadlinePassed) as late:
        async with slots.hold("b", time.monotonic() + 0.02):
            pytest.fail("no slot was free")
    assert late.value.status == 504 and slots.timed_out == 1
    cancelled = calls.start("b")
    await asyncio.sleep(0)
    calls.tasks[cancelled].cancel()
    await asyncio.gather(calls.tasks[cancelled], return_exceptions=True)
    after = calls.start("b")
    await calls.release(holder)
    assert calls.entered == ["a0", f"b{after}"] and slots.busy == 1
    await calls.release(after)
    assert slots.busy == 0 and slots.held("a") == slots.held("b") == 0


async def test_a_call_that_could_not_end_by_its_deadline_is_refused_at_once_over_share_first() -> None:
    """With hold times measured, a call whose wait behind its own org's queue and its own hold would
    end past its deadline is refused at once (503); another org's call with nothing queued waits."""
    slots = FairSlots(2, 4)
    calls = Calls(slots)
    holders = [calls.start("a"), calls.start("a")]
    queued = [calls.start("a") for _ in range(2)]
    await asyncio.sleep(0)
    soon = time.monotonic() + 2.0
    slots.hold_s, slots.holds = 1.0, MIN_HOLDS  # as if measured: a search holds its slot a second
    with pytest.raises(AtCapacity) as refused:
        async with slots.hold("a", soon):  # two of a's ahead on two slots, then its own: ~2.3 s
            pytest.fail("refused on arrival")
    assert refused.value.status == 503 and "at capacity" in refused.value.message and slots.refused == 1
    victim = calls.start("b", soon)  # b: next at the first slot to free, then its own: ~1.3 s
    await asyncio.sleep(0)
    assert slots.refused == 1 and slots.waited == 3
    await calls.release(holders[0])
    assert calls.entered[-1] == f"b{victim}"
    for i in (holders[1], victim, *queued):
        await calls.release(i)
    assert slots.busy == 0


async def test_nothing_is_refused_on_arrival_before_hold_times_are_measured() -> None:
    slots = FairSlots(1, 4)
    calls = Calls(slots)
    holder = calls.start("a")
    await asyncio.sleep(0)
    waiting = calls.start("a", time.monotonic() + 0.001)
    await asyncio.sleep(0)
    assert slots.refused == 0 and slots.waited == 1
    await asyncio.gather(calls.tasks[waiting], return_exceptions=True)
    assert slots.timed_out == 1
    await calls.release(holder)
