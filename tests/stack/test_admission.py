"""Admission control and dispatch: the adaptive limit's rules, the shedding rule, and the
real broker (its own thread, real ZeroMQ sockets) in front of scripted workers whose service time
and feedback the test controls.

Here: the checks through running servers; the pure parts are in
tests/unit/test_admission.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Awaitable, Iterator

import pytest
import zmq

from bench.lib.transport import transport_response
from ibex_context.broker.broker import Broker
from ibex_context.client.client import AsyncClient
from ibex_context.shared.config.settings import BrokerSettings, ClientSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.errors import IbexError, Overloaded
from tests.helpers import ScriptedWorker

# ----------------------------------------------------------- the real broker, scripted workers


class FeedbackWorker(ScriptedWorker):
    """READY with ``capacity``, answers each request after ``delay_s`` with a minimal valid reply
    and the feedback ``overloaded`` and ``gate_full`` say when it arrives; ``sent`` counts what it
    served."""

    heartbeat_s = 0.1

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, name: str, capacity: int,
                 delay_s: float = 0.0) -> None:
        super().__init__(ctx, backend, name, capacity)
        self.delay_s = delay_s
        self.overloaded = False
        self.gate_full = False  # what its replies say of its memory gate
        self.body = encode(transport_response("-", {}).model_copy(update={"worker_id": name}))

    def answer(self, msg: P.Dispatch) -> tuple[float, bytes, P.Feedback]:
        return self.delay_s, self.body, P.Feedback(self.overloaded, 0, self.gate_full)


@contextlib.contextmanager
def broker_with(workers: list[tuple[str, int, float]],
                **settings: object) -> Iterator[tuple[Broker, list[FeedbackWorker]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    broker = Broker(settings=BrokerSettings(heartbeat_interval_ms=100, **settings),  # type: ignore[arg-type]
                    frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", ctx=ctx)
    thread = threading.Thread(target=broker.serve_forever, daemon=True)
    thread.start()
    scripted = [FeedbackWorker(ctx, broker.backend_endpoint, n, cap, delay) for n, cap, delay in workers]
    for w in scripted:
        w.start()
    try:
        end = time.monotonic() + 10
        while len(broker.table) < len(scripted):
            assert time.monotonic() < end, "scripted workers did not register"
            time.sleep(0.01)
        yield broker, scripted
    finally:
        for w in scripted:
            w.stop.set()
            w.join(5)
        broker.stop()
        thread.join(5)
        ctx.term()


def _fields(i: int) -> dict[str, object]:
    return {"request_id": f"a-{i}", "org_id": "acme", "agent_id": "bot", "model": "gpt-4o", "query": "q"}


async def test_equal_workers_get_equal_work() -> None:
    """One request at a time: every worker has the same free credit at every pick, so only the
    tie-break decides (the highest routing id first would give one worker everything)."""
    with broker_with([("w0", 4, 0.0), ("w1", 4, 0.0), ("w2", 4, 0.0)]) as (broker, _):
        async with AsyncClient(broker.frontend_endpoint) as c:
            await c.wait_connected()
            seen = collections.Counter([(await c.assemble(timeout=2.0, **_fields(i))).worker_id for i in range(60)])
    assert seen == {"w0": 20, "w1": 20, "w2": 20}


async def test_overload_feedback_lowers_the_limit_and_clean_replies_restore_it() -> None:
    with broker_with([("w0", 8, 0.002)]) as (broker, (w0,)):
        async with AsyncClient(broker.frontend_endpoint) as c:
            await c.wait_connected()
            w0.overloaded = True
            await asyncio.gather(*[c.assemble(timeout=2.0, **_fields(i)) for i in range(40)])
            low = (await c.status())["workers"]["w0"]["limit"]
            w0.overloaded = False
            for k in range(10):  # bursts that fill the limit: clean replies while it binds
                await asyncio.gather(*[c.assemble(timeout=2.0, **_fields(100 + 20 * k + i)) for i in range(20)])
            high = (await c.status())["workers"]["w0"]["limit"]
    assert low < 8 and high == 8, (low, high)


NO_THROTTLE = ClientSettings(client_throttle_k=0)  # every call reaches the broker


@pytest.mark.parametrize("lifo", [False, True], ids=["fifo", "lifo"])
async def test_a_standing_queue_is_shed_on_receipt_and_nothing_is_late(lifo: bool) -> None:
    """Offered three times what one slow worker can serve, for long enough to make the queue stand:
    the surplus is refused OVERLOADED on receipt or (``lifo``: served newest first) once too little
    of its time is left to be answered in full (said so, and counted), the rest is served, and no
    answer of any kind comes after its deadline."""
    deadline_s = 0.1
    with broker_with([("w0", 2, 0.01)], admission_lifo=lifo) as (broker, _):
        async with AsyncClient(broker.frontend_endpoint, settings=NO_THROTTLE) as c:
            await c.wait_connected()
            for i in range(30):  # the broker learns the service time first
                await c.assemble(timeout=2.0, **_fields(i))

            async def one(i: int) -> tuple[str, float]:
                t0 = time.monotonic()
                try:
                    await c.assemble(timeout=deadline_s, **_fields(1000 + i))
                    return "ok", time.monotonic() - t0
                except Overloaded as exc:
                    assert "shed on receipt" in exc.message or "in the standing queue" in exc.message, exc
                    return "OVERLOADED", time.monotonic() - t0
                except IbexError as exc:
                    return exc.code.value, time.monotonic() - t0

            lags: list[float] = []
            lag = asyncio.create_task(_loop_lag(lags))
            tasks = []
            for i in range(240):  # 600/s for 0.4 s against ~200/s of service
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(1 / 600)
            results = await asyncio.gather(*tasks)
            lag.cancel()
            worst_lag = max(lags, default=0.0)
    outcomes = collections.Counter(o for o, _ in results)
    assert outcomes["OVERLOADED"] > 0 and outcomes["ok"] > 0, outcomes
    # A request shed, or answered, with little time left may reach its caller just after the caller's
    # own clock ended it (DEADLINE_EXCEEDED there): never fewer refusals or answers seen than the
    # broker sent, and what the broker sent beyond them is at most what the caller timed out.
    shed_by_broker = broker.stats["shed_overloaded"] + broker.stats["shed_stale"]
    replied = broker.stats["replies"] - 30
    assert shed_by_broker >= outcomes["OVERLOADED"] and replied >= outcomes["ok"]
    assert (shed_by_broker - outcomes["OVERLOADED"]) + (replied - outcomes["ok"]) <= outcomes["DEADLINE_EXCEEDED"]
    assert sum(outcomes.values()) == 240
    # measured by this process's own clock: its loop's stalls (240 tasks, a loaded machine) are not the
    # service's lateness, so the slack grows by the longest stall the loop showed during the burst
    assert all(t <= deadline_s + 0.05 + worst_lag for _, t in results), (max(t for _, t in results), worst_lag)


async def _loop_lag(lags: list[float], period_s: float = 0.005) -> None:
    """Record in ``lags`` how late this event loop wakes a sleeper (its own stalls), until cancelled."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(period_s)
        lags.append(time.monotonic() - t0 - period_s)


async def _outcome(call: Awaitable[object]) -> str:
    try:
        await call
        return "ok"
    except Overloaded as exc:
        return f"OVERLOADED: {exc.message}"


async def _gates_full(w0: FeedbackWorker, c: AsyncClient) -> asyncio.Task[str]:
    """The worker's replies say its memory gate is full: one acme request's reply tells the broker
    so while a second one is still in flight (returned, to be awaited)."""
    w0.gate_full = True
    first = asyncio.create_task(_outcome(c.assemble(timeout=3.0, **_fields(0))))
    await asyncio.sleep(w0.delay_s / 3)
    held = asyncio.create_task(_outcome(c.assemble(timeout=3.0, **_fields(1))))
    assert await first == "ok"
    return held


async def test_full_memory_gates_refuse_an_org_at_its_share_on_receipt() -> None:
    """Every worker's gate full: acme, holding every request in flight, is refused OVERLOADED on
    receipt (no hop to a worker); globex, holding none, goes on to the worker (whose gate keeps
    it a slot). Every call has exactly one outcome, and the worker saw only what was admitted."""
    with broker_with([("w0", 4, 0.3)]) as (broker, (w0,)):
        async with AsyncClient(broker.frontend_endpoint, settings=NO_THROTTLE) as c:
            await c.wait_connected()
            held = await _gates_full(w0, c)
            refused = await _outcome(c.assemble(timeout=2.0, **_fields(2)))
            other = await _outcome(c.assemble(timeout=2.0, **{**_fields(3), "org_id": "globex"}))
            assert await held == "ok"
    assert refused.startswith("OVERLOADED") and "limit on memory-service calls is full" in refused, refused
    assert other == "ok"
    assert broker.stats["shed_gates_full"] == 1 and broker.stats["replies"] == 3 and w0.sent == 3
    assert not broker.pending and not broker.queue


async def test_the_client_throttles_an_org_the_service_refuses() -> None:
    """With the service refusing acme's calls (full gates), the client starts refusing them itself,
    typed OVERLOADED and at once; every call still has exactly one outcome, the refusals the
    broker made and the client's add up to the calls, and ``assemble_or_degrade`` answers a
    throttled call with its degraded fallback."""
    with broker_with([("w0", 4, 1.0)]) as (broker, (w0,)):
        async with AsyncClient(broker.frontend_endpoint) as c:
            await c.wait_connected()
            await c.prepare_fallback()
            held = await _gates_full(w0, c)
            outcomes = [await _outcome(c.assemble(timeout=2.0, **_fields(10 + i))) for i in range(60)]
            throttled = c.stats["throttled"]
            degraded = await c.assemble_or_degrade(timeout=2.0, **_fields(100))
            assert await held == "ok"
    assert all(o.startswith("OVERLOADED") for o in outcomes), outcomes
    local = sum("adaptive throttle" in o for o in outcomes)
    assert local == throttled > 0 and local + broker.stats["shed_gates_full"] >= 60, (local, broker.stats)
    assert degraded.degraded and w0.sent == 2
