"""One org's heavy requests queue behind each other, not in front of another org's (``worker.fair``,
``worker.cost``): the turn rules on a real loop, and the real stack (broker, two workers, memory
service, Redis) with acme sending heavy requests (tool-call rounds near the item limit, over it, a
raw fill-byte JPEG) while globex sends light ones, which must come back on time and undegraded.

Here: the checks through running servers; the pure parts are in
tests/unit/test_org_fairness.py.
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
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from tests.helpers import eventually, start_stack
from tests.stack.test_request_cost import ITEMS_PER_PAIR, fill_jpeg, raw_frames, tool_pairs

pytestmark = pytest.mark.timeout(300)


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
