"""One org's heavy requests queue behind each other, not in front of another org's (``worker.fair``,
``worker.cost``): the turn rules on a real loop, and the real stack (broker, two workers, memory
service, Redis) with acme sending heavy requests (tool-call rounds near the item limit, over it, a
raw fill-byte JPEG) while globex sends light ones, which must come back on time and undegraded.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_org_fairness.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ibex_context.shared.wire.errors import DeadlineExceeded
from ibex_context.worker.fair import FairTurns

pytestmark = pytest.mark.timeout(300)

S = 1_000_000_000


def busy(ms: float) -> None:
    end = time.monotonic_ns() + int(ms * 1e6)
    while time.monotonic_ns() < end:
        pass


# ------------------------------------------------------------------------------ the rules alone


async def idle(turns: FairTurns) -> None:
    """The last stage's turn is free again within a few loop iterations."""
    for _ in range(10):
        await asyncio.sleep(0)
    assert turns.busy is False


async def test_the_next_turn_goes_to_the_org_that_used_the_least_cpu() -> None:
    turns = FairTurns()
    order: list[str] = []
    deadline = time.monotonic_ns() + 10 * S

    async def stage(org: str, ms: float) -> None:
        async with turns.turn(org, deadline):
            order.append(org)
            busy(ms)

    # acme's first stage runs; while it does, three more of acme's and two of globex's queue.
    tasks = [asyncio.create_task(stage("acme", 20)) for _ in range(4)]
    tasks += [asyncio.create_task(stage("globex", 1)) for _ in range(2)]
    await asyncio.gather(*tasks)
    assert order[:4] == ["acme", "globex", "globex", "acme"], order  # not three acme stages first
    await idle(turns)


async def test_waiting_past_the_deadline_is_deadline_exceeded_and_passes_the_turn_on() -> None:
    turns = FairTurns()
    ran: list[str] = []

    async def stage(org: str, deadline_ns: int, ms: float) -> None:
        async with turns.turn(org, deadline_ns):
            ran.append(org)
            busy(ms)

    far = time.monotonic_ns() + 10 * S
    first = asyncio.create_task(stage("acme", far, 0))
    await asyncio.sleep(0)
    hog = asyncio.create_task(stage("acme", far, 0))  # queued behind the first
    late = asyncio.create_task(stage("globex", time.monotonic_ns() + 1, 0))  # expires while queued
    ok = asyncio.create_task(stage("initech", far, 0))
    results = await asyncio.gather(first, hog, late, ok, return_exceptions=True)
    assert isinstance(results[2], DeadlineExceeded) and "waited for its turn" in results[2].message
    assert sorted(ran) == ["acme", "acme", "initech"] and turns.stats["expired_waiting"] == 1
    await idle(turns)


async def test_one_org_holds_at_most_per_org_slots_and_others_go_on() -> None:
    turns = FairTurns(per_org=2)
    release, inside = asyncio.Event(), []
    deadline = time.monotonic_ns() + 10 * S

    async def assembly(org: str) -> None:
        async with turns.slot(org, deadline):
            inside.append(org)
            await release.wait()

    tasks = [asyncio.create_task(assembly("acme")) for _ in range(4)]
    tasks += [asyncio.create_task(assembly("globex")) for _ in range(2)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(inside) == ["acme", "acme", "globex", "globex"]
    release.set()
    await asyncio.gather(*tasks)
    assert inside.count("acme") == 4
    assert "acme" not in turns.orgs or turns.orgs["acme"].running == 0
