"""Held slots on the real stack (broker, two workers, the memory service with faults, Redis;
docs/architecture.md "Admission control", ``IBEX_ADMISSION_HOLD``): once the broker has learned a
long service time, one org's flood whose memory calls the memory service refuses at once (503) is
answered degraded in milliseconds, and each of its slots stays held for that org; another org's
requests, asking nothing of the memory service, are dispatched beside the held slots and answered
whole, on time, never refused, however long the holds last.

The proof that a held slot is free for every other org (the broker's dispatch, timed against
workers whose replies a test scripts) is in tests/stack/test_broker_fair_share.py."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(300)

# Branch limits far above the warm-up's injected latency: the warm-up's answers are whole and
# slow, so the service time the broker learns (and each hold) is about SLOW_MS.
ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "2000", "IBEX_HOT_TIMEOUT_MS": "2000",
       "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_RETRIEVAL_TIMEOUT_MS": "3000",
       "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30"}
SLOW_MS = 800.0
WARM = 24  # whole answers before the flood: more than the broker needs to trust its service time
FLOOD_SENDERS = 8
FLOOD_TIMEOUT_S = 3.0  # longer than a hold: what waits behind the flood's own holds is answered in time
VICTIM_REQUESTS = 20
VICTIM_TIMEOUT_S = 0.5  # well under a hold: a victim request held back by the flood's holds would miss it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("admissionhold"), workers=2, enable_faults=True, env=ENV)
    try:
        yield s
    finally:
        s.stop()


def outcome(r: AssembleResponse | IbexError) -> str:
    if isinstance(r, IbexError):
        return r.code.value
    return "degraded" if r.degraded else "whole"


async def ask(client: AsyncClient, org: str, query: str, timeout: float, **options: Any) -> str:
    agent = "support-agent" if org == "acme" else "research-agent"
    try:
        r: AssembleResponse | IbexError = await client.assemble(
            org_id=org, agent_id=agent, model="gpt-4.1-mini", query=query, timeout=timeout,
            **({"options": options} if options else {}))
    except IbexError as exc:
        r = exc
    return outcome(r)


async def test_a_floods_held_slots_leave_another_org_served_whole_and_on_time(stack: LocalStack) -> None:
    numbers = itertools.count()
    async with AsyncClient(stack.frontends) as client, httpx.AsyncClient(timeout=5) as http:
        await client.wait_connected()
        faults = stack.memory_url + "/_faults"
        (await http.put(faults, json={"endpoint": "all", "latency_ms": SLOW_MS})).raise_for_status()
        warm = await asyncio.gather(*[ask(client, "acme", f"What did customer {next(numbers)} say?", 3.0)
                                      for _ in range(WARM)])
        assert Counter(warm)["whole"] >= WARM - 2, warm  # the service time learned is about SLOW_MS
        (await http.put(faults, json={"endpoint": "all", "status": 503})).raise_for_status()
        stop = asyncio.Event()
        flood: Counter[str] = Counter()

        async def sender() -> None:
            while not stop.is_set():
                flood[await ask(client, "acme", f"What did customer {next(numbers)} say?", FLOOD_TIMEOUT_S)] += 1
                await asyncio.sleep(0.005)

        senders = [asyncio.create_task(sender()) for _ in range(FLOOD_SENDERS)]
        try:
            held: list[int] = []

            async def holding() -> bool:
                row = (await client.status())["orgs"].get("acme", {})
                held.append(row.get("held", 0))
                return held[-1] > 0

            for _ in range(500):
                if await holding():
                    break
                await asyncio.sleep(0.01)
            assert held and held[-1] > 0, f"the flood's slots never held: {held[-20:]}, flood {dict(flood)}"
            # The other org asks nothing of the memory service: whole answers, in a few milliseconds.
            served = [await ask(client, "globex", f"Summarise part {i}.", VICTIM_TIMEOUT_S,
                                include_hot=False, include_cold=False) for i in range(VICTIM_REQUESTS)]
            snap = await client.status()
        finally:
            stop.set()
            await asyncio.gather(*senders)
            (await http.delete(faults)).raise_for_status()
    print(f"\n  flood: {dict(flood)}; victim: {Counter(served)}; stats: held_slots_given "
          f"{snap['stats'].get('held_slots_given')}, shed_held {snap['stats'].get('shed_held', 0)}")
    assert served == ["whole"] * VICTIM_REQUESTS, Counter(served)
    victim = snap["orgs"].get("globex", {})
    assert victim.get("held", 0) == 0 and victim.get("shed", 0) == 0
    assert snap["stats"]["held_slots_given"] > 0
    # The flood was answered degraded (its memory calls refused), and never after its deadline.
    assert flood["degraded"] > 0 and not flood["DEADLINE_EXCEEDED"], dict(flood)
