"""One org's heavy requests queue behind each other, not in front of another org's (``worker.fair``,
``worker.cost``): the turn rules on a real loop, and the real stack (broker, two workers, memory
service, Redis) with acme sending heavy requests (tool-call rounds near the item limit, over it, a
raw fill-byte JPEG) while globex sends light ones, which must come back on time and undegraded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.config.settings import WorkerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.errors import DeadlineExceeded, IbexError
from ibex_context.shared.wire.models import AssembleResponse
from ibex_context.worker.fair import FairTurns
from tests.helpers import eventually, start_stack
from tests.test_request_cost import ITEMS_PER_PAIR, fill_jpeg, raw_frames, tool_pairs

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


# ----------------------------------------------------------------------------- the real stack

# Branch timeouts far above a normal search so a loaded 2-core box does not degrade globex by
# itself; a heavy request used to hold a worker's loop for longer (a 3,300-round conversation
# ~0.5 s, the 13 MB payload of empty parts ~20 s).
ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "800", "IBEX_HOT_TIMEOUT_MS": "800",
       "IBEX_COLD_TIMEOUT_MS": "800", "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_RETRIEVAL_TIMEOUT_MS": "1500",
       "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30"}
HEAVY_SENDERS = 3
LIGHT_REQUESTS = 60
LIGHT_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("fairness"), workers=2, env=ENV)
    try:
        yield s
    finally:
        s.stop()


def heavy_kinds() -> list[list[dict[str, Any]]]:
    near = WorkerSettings().max_request_items // ITEMS_PER_PAIR - 10
    image = [{"role": "user", "content": [{"type": "text", "text": "Is this my invoice?"}, {
        "type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + fill_jpeg(700_000)}}]}]
    tiny_parts = [{"role": "user", "content": [{"type": "text", "text": ""}] * 1000} for _ in range(400)]
    return [tool_pairs(near), image, tool_pairs(3300), tiny_parts]


async def heavy_sender(stack: LocalStack, n: int, stop: asyncio.Event, out: list[str]) -> None:
    kinds = heavy_kinds()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.frontend)
    i = 0
    try:
        while not stop.is_set():
            await sock.send_multipart(raw_frames(1000 * n + i, model="gpt-4.1", messages=kinds[i % len(kinds)]))
            try:
                reply = await asyncio.wait_for(sock.recv_multipart(), 30)
                out.append("reply" if reply[1] == P.REPLY else msgpack.unpackb(reply[3]).get("code", "?"))
            except TimeoutError:
                out.append("no reply")
            i += 1
    finally:
        sock.close()
        ctx.term()


async def test_heavy_requests_of_one_org_leave_another_orgs_on_time_and_whole(stack: LocalStack) -> None:
    heavy: list[str] = []
    light: list[tuple[AssembleResponse | IbexError, float]] = []
    stop = asyncio.Event()
    async with AsyncClient(stack.frontends) as client:
        await client.wait_connected()

        async def one(i: int) -> None:
            t0 = time.monotonic()
            try:
                r: AssembleResponse | IbexError = await client.assemble(
                    org_id="globex", agent_id="research-agent", model="gpt-4.1-mini", format="openai",
                    query="Summarise what we know about the literature review.", timeout=LIGHT_TIMEOUT_S,
                    messages=[{"role": "user", "content": f"request {i}"}])
            except IbexError as exc:
                r = exc
            light.append((r, time.monotonic() - t0))

        senders = [asyncio.create_task(heavy_sender(stack, n, stop, heavy)) for n in range(HEAVY_SENDERS)]
        await eventually("acme's load flowing", lambda: len(heavy) >= HEAVY_SENDERS, timeout_s=60)
        for start in range(0, LIGHT_REQUESTS, 4):
            await asyncio.gather(*(one(i) for i in range(start, start + 4)))
        stop.set()
        await asyncio.gather(*senders)

    good = [t for r, t in light if isinstance(r, AssembleResponse) and not r.degraded and r.packed]
    bad = [(type(r).__name__ if isinstance(r, IbexError) else r.degraded_reasons, round(t, 2))
           for r, t in light if not (isinstance(r, AssembleResponse) and not r.degraded and r.packed)]
    outcomes = {k: heavy.count(k) for k in set(heavy)}
    print(f"\n  globex: {len(good)}/{len(light)} whole, slowest {max(t for _, t in light):.2f} s; acme: {outcomes}")
    assert len(light) == LIGHT_REQUESTS
    assert len(good) >= 0.95 * LIGHT_REQUESTS, (bad, outcomes)
    assert outcomes.get("reply", 0) >= HEAVY_SENDERS and outcomes.get("INVALID_REQUEST", 0) >= 1  # acme served too
