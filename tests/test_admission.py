"""Admission control and dispatch: the adaptive limit's rules, the shedding rule, and the
real broker (its own thread, real ZeroMQ sockets) in front of scripted workers whose service time
and feedback the test controls."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from bench.lib.transport import transport_response
from ibex_context.broker.admission import (
    BACKOFF,
    LOOP_LAG_US,
    MIN_LIMIT,
    STANDING_NS,
    Limiter,
    ServiceTime,
    StandingQueue,
    expected_wait_ns,
    shed,
)
from ibex_context.broker.broker import Broker
from ibex_context.client.client import AsyncClient
from ibex_context.shared.config.settings import BrokerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode
from ibex_context.shared.wire.errors import IbexError, Overloaded

MS = 1_000_000

# ------------------------------------------------------------------------------ the rules alone


def test_overload_feedback_cuts_the_limit_once_per_service_time() -> None:
    lim = Limiter(16)
    assert lim.limit == 16  # a new worker starts with its whole credit
    lim.on_reply(inflight=16, overloaded=True, loop_lag_us=0, now_ns=100 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF
    lim.on_reply(inflight=12, overloaded=True, loop_lag_us=0, now_ns=105 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF  # the same burst of late replies counts once
    lim.on_reply(inflight=12, overloaded=False, loop_lag_us=LOOP_LAG_US + 1, now_ns=111 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF**2  # a saturated worker loop is an overload signal too
    for k in range(200):
        lim.on_reply(inflight=1, overloaded=True, loop_lag_us=0, now_ns=(200 + 20 * k) * MS, service_ns=10 * MS)
    assert lim.limit == MIN_LIMIT and lim.slots == MIN_LIMIT


def test_clean_replies_raise_a_binding_limit_up_to_the_cap() -> None:
    lim = Limiter(8, limit=4.0)
    lim.on_reply(inflight=3, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 4.0  # not binding: nothing learned about a higher limit
    lim.on_reply(inflight=4, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 4.25  # one slot per limit's worth of clean replies
    for _ in range(100):
        lim.on_reply(inflight=lim.slots, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 8 and lim.slots == 8
    lim.set_cap(3)
    assert lim.slots == 3


def test_expected_wait() -> None:
    assert expected_wait_ns(0, 4, 1, 10 * MS) == 0  # a slot is free and nobody is ahead
    assert expected_wait_ns(0, 4, 0, 10 * MS) == 0  # the first of four slots frees in ~quarter service
    assert expected_wait_ns(7, 4, 0, 10 * MS) == pytest.approx(15 * MS)
    assert expected_wait_ns(3, 0, 0, 10 * MS) == float("inf")


def test_only_a_standing_queue_sheds() -> None:
    kw = {"service_ns": 10 * MS, "target_ns": 5 * MS}
    assert not shed(wait_ns=500 * MS, remaining_ns=100 * MS, standing=False, **kw)  # a burst: let in
    assert shed(wait_ns=91 * MS, remaining_ns=100 * MS, standing=True, **kw)  # cannot finish in time
    assert shed(wait_ns=30 * MS, remaining_ns=100 * MS, standing=True, **kw)  # over target and a quarter
    assert not shed(wait_ns=20 * MS, remaining_ns=100 * MS, standing=True, **kw)
    assert not shed(wait_ns=4 * MS, remaining_ns=100 * MS, standing=True, **kw)
    assert not shed(wait_ns=300 * MS, remaining_ns=4_000 * MS, standing=True, **kw)  # seconds to spare


def test_standing_queue_is_a_whole_interval_over_target() -> None:
    q = StandingQueue(5 * MS)
    q.on_dispatch(6 * MS, now_ns=0)
    assert not q.standing(STANDING_NS - 1)
    assert q.standing(STANDING_NS)
    q.on_dispatch(1 * MS, now_ns=STANDING_NS + 1)  # one quick dispatch: the queue drained
    assert not q.standing(2 * STANDING_NS)
    q.on_dispatch(9 * MS, now_ns=0)
    q.reset()
    assert not q.standing(10 * STANDING_NS)


def test_service_time_is_trusted_after_enough_replies() -> None:
    st = ServiceTime()
    for _ in range(19):
        st.observe(10 * MS)
    assert not st.trusted and st.mean_ns == 10 * MS
    st.observe(30 * MS)
    assert st.trusted and 10 * MS < st.mean_ns < 30 * MS


def test_feedback_frame_round_trip_and_a_bad_one_still_forwards_the_reply() -> None:
    fb = P.Feedback(True, 1234)
    msg = P.parse_worker_message(P.worker_reply_frames(P.REPLY, b"c", b"r", b"x", fb))
    assert msg == P.WorkerReply(P.REPLY, b"c", b"r", b"x", fb)
    bad = P.parse_worker_message([P.TAG, P.REPLY, b"c", b"r", b"x", b"\x01"])
    assert bad == P.WorkerReply(P.REPLY, b"c", b"r", b"x", None)
    assert P.Feedback.unpack(P.Feedback(False, -5).pack()) == P.Feedback(False, 0)


# ----------------------------------------------------------- the real broker, scripted workers


class ScriptedWorker(threading.Thread):
    """A DEALER worker: READY with ``capacity``, answers each request after ``delay_s`` with a
    minimal valid reply and the feedback ``overloaded()`` says; counts what it served."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, name: str, capacity: int,
                 delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.ctx, self.backend, self.name, self.capacity, self.delay_s = ctx, backend, name, capacity, delay_s
        self.overloaded = False
        self.served = 0
        self.stop = threading.Event()
        self.body = encode(transport_response("-", {}).model_copy(update={"worker_id": name}))

    def run(self) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.backend)
        info = P.Info(self.capacity, self.name, os.getpid())
        s.send_multipart(P.ready_frames(info))
        due: list[tuple[float, list[bytes]]] = []
        last_hb = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            for at, frames in [d for d in due if d[0] <= now]:
                due.remove((at, frames))
                s.send_multipart(frames)
                self.served += 1
            if now - last_hb > 0.1:
                s.send_multipart(P.heartbeat_frames(info))
                last_hb = now
            if not s.poll(1):
                continue
            msg = P.parse_broker_message(s.recv_multipart())
            if isinstance(msg, P.Dispatch):
                reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, self.body,
                                              P.Feedback(self.overloaded, 0))
                due.append((time.monotonic() + self.delay_s, reply))
        s.close(linger=0)


@contextlib.contextmanager
def broker_with(workers: list[tuple[str, int, float]],
                **settings: object) -> Iterator[tuple[Broker, list[ScriptedWorker]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    broker = Broker(settings=BrokerSettings(heartbeat_interval_ms=100, **settings),  # type: ignore[arg-type]
                    frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", ctx=ctx)
    thread = threading.Thread(target=broker.serve_forever, daemon=True)
    thread.start()
    scripted = [ScriptedWorker(ctx, broker.backend_endpoint, n, cap, delay) for n, cap, delay in workers]
    for w in scripted:
        w.start()
    try:
        end = time.monotonic() + 10
        while len(broker.workers) < len(scripted):
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


async def test_a_standing_queue_is_shed_on_receipt_and_nothing_is_late() -> None:
    """Offered three times what one slow worker can serve, for long enough to make the queue stand:
    the surplus is refused OVERLOADED on receipt (said so, and counted), the rest is served, and
    no answer of either kind comes after its deadline."""
    deadline_s = 0.1
    with broker_with([("w0", 2, 0.01)]) as (broker, _):
        async with AsyncClient(broker.frontend_endpoint) as c:
            await c.wait_connected()
            for i in range(30):  # the broker learns the service time first
                await c.assemble(timeout=2.0, **_fields(i))

            async def one(i: int) -> tuple[str, float]:
                t0 = time.monotonic()
                try:
                    await c.assemble(timeout=deadline_s, **_fields(1000 + i))
                    return "ok", time.monotonic() - t0
                except Overloaded as exc:
                    assert "shed on receipt" in exc.message, exc
                    return "OVERLOADED", time.monotonic() - t0
                except IbexError as exc:
                    return exc.code.value, time.monotonic() - t0

            tasks = []
            for i in range(240):  # 600/s for 0.4 s against ~200/s of service
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(1 / 600)
            results = await asyncio.gather(*tasks)
    outcomes = collections.Counter(o for o, _ in results)
    assert outcomes["OVERLOADED"] > 0 and outcomes["ok"] > 0, outcomes
    assert broker.stats["shed_overloaded"] == outcomes["OVERLOADED"]
    assert all(t <= deadline_s + 0.05 for _, t in results), max(t for _, t in results)
