"""Admission at the memory service on the real stack (broker, two workers, memory service with
faults, Redis): with the memory service slowed past every retrieval limit, a flood of one org's new
questions is answered at once by the workers' memory gate (``worker.memgate``: degraded, its memory
branches ``MemoryAtCapacity``, no memory call made), or, while every gate is full, refused
OVERLOADED on receipt by the broker or by the client's throttle, instead of every request waiting
out its memory calls; every answer comes by its deadline; once the
service recovers, another org's requests are served whole while the flood goes on."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from ibex_context.worker.memgate import AT_CAPACITY
from tests.helpers import eventually, start_stack

pytestmark = pytest.mark.timeout(300)

# The broker's own adaptive limit and dispatch rate off (each worker holds its whole credit, and
# is dispatched as fast as its slots free), so what refuses the flood is the workers' memory gate
# alone (the rate, and how it gives way to the gates when the memory service answers nothing in
# time: tests/stack/test_admission_rate.py). Branch limits far above a normal search, so a loaded
# 2-core box does not degrade the victim by itself; the injected latency is far above them, so
# every memory call of the slowed phase times out.
ENV = {"IBEX_ADAPTIVE_LIMIT": "false", "IBEX_ADMISSION_RATE": "false", "IBEX_HEARTBEAT_INTERVAL_MS": "200",
       "IBEX_DIRECTIVE_TIMEOUT_MS": "800",
       "IBEX_HOT_TIMEOUT_MS": "800", "IBEX_COLD_TIMEOUT_MS": "800", "IBEX_CONTEXT_TIMEOUT": "1500",
       "IBEX_RETRIEVAL_TIMEOUT_MS": "1500",
       "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30"}
SLOW_MS = 5_000.0
FLOOD_SENDERS = 16
TIMEOUT_S = 3.0
VICTIM_REQUESTS = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("memadmission"), workers=2, enable_faults=True, env=ENV)
    try:
        yield s
    finally:
        s.stop()


def outcome(r: AssembleResponse | IbexError) -> str:
    if isinstance(r, IbexError):
        return r.code.value
    if any(AT_CAPACITY in reason for reason in r.degraded_reasons):
        return "gate"
    return "degraded" if r.degraded else "whole"


class Flood:
    """``FLOOD_SENDERS`` closed-loop senders of acme's new questions; each outcome and its time."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.seen: list[tuple[str, float]] = []
        self.stop = asyncio.Event()
        self.numbers = itertools.count()

    async def sender(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r: AssembleResponse | IbexError = await self.client.assemble(
                    org_id="acme", agent_id="support-agent", model="gpt-4.1-mini",
                    query=f"What did customer {next(self.numbers)} say about the invoice?", timeout=TIMEOUT_S)
            except IbexError as exc:
                r = exc
            self.seen.append((outcome(r), time.monotonic() - t0))
            await asyncio.sleep(0.005)

    def since(self, start: int) -> Counter[str]:
        return Counter(o for o, _ in self.seen[start:])


async def victim(client: AsyncClient, i: int) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        r: AssembleResponse | IbexError = await client.assemble(
            org_id="globex", agent_id="research-agent", model="gpt-4.1-mini", timeout=TIMEOUT_S,
            query=f"Summarise what we know about the literature review, part {i}.")
    except IbexError as exc:
        r = exc
    return outcome(r), time.monotonic() - t0


async def test_a_flood_against_a_slowed_memory_service_is_refused_at_once_and_another_org_is_served(
        stack: LocalStack) -> None:
    async with AsyncClient(stack.frontends) as client, httpx.AsyncClient(timeout=5) as http:
        await client.wait_connected()
        flood = Flood(client)
        faults = stack.memory_url + "/_faults"
        (await http.put(faults, json={"endpoint": "all", "latency_ms": SLOW_MS})).raise_for_status()
        senders = [asyncio.create_task(flood.sender()) for _ in range(FLOOD_SENDERS)]
        try:
            await eventually("the flood answered while the service is slow", lambda: len(flood.seen) >= 200,
                             timeout_s=120)
            slow = flood.since(0)
            refused_on_receipt = (await client.status())["stats"].get("shed_gates_full", 0)
            (await http.delete(faults)).raise_for_status()
            healed = len(flood.seen)
            # The calls admitted while the service was slow hold their slots to their limits; the
            # victim comes once the flood is served again.
            await eventually("the flood served again", lambda: flood.since(healed)["whole"] >= 10, timeout_s=120)
            served = [await victim(client, i) for i in range(VICTIM_REQUESTS)]
            flooding = flood.since(healed)
        finally:
            flood.stop.set()
            await asyncio.gather(*senders)
    print(f"\n  slowed: {dict(slow)}; healed: {dict(flooding)}; victim: {Counter(o for o, _ in served)}")
    # Every answer by its deadline (the client hands back nothing later: DEADLINE_EXCEEDED at worst).
    assert all(t <= TIMEOUT_S + 0.25 for _, t in flood.seen + served)
    # While the service is slow, the flood is mostly refused at once rather than left to wait out
    # memory calls that cannot answer: the gate holds a few per worker, the rest are refused (by the
    # gate, or with every gate full by the broker on receipt and then by the client's throttle).
    assert slow["gate"] + slow["OVERLOADED"] > slow["degraded"] + slow["DEADLINE_EXCEEDED"], slow
    # The workers told the broker their gates were full: it refused acme itself, with no hop.
    assert refused_on_receipt > 0
    # Once it recovers, the other org is served whole while the flood goes on (its first request on
    # a worker waits at most 20 ms for a slot, which on a loaded box may not be enough).
    assert Counter(o for o, _ in served)["whole"] >= VICTIM_REQUESTS - 2, served
