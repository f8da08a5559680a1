"""Faults survived with real processes: every request ends in exactly one terminal outcome.

Under each fault the test sends a burst of requests, injects the fault while they are in flight,
and checks that sent == responses + typed errors, that nothing came back after its deadline, and
that nothing was answered twice. Faults are injected when the broker's STATUS shows the state
the test is about (requests in flight, a worker holding work), never after a fixed delay, so each
test checks what it says however fast the machine is. Time bounds carry generous margins.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack, free_port, wait_for
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.errors import IbexError
from ibex_context.shared.wire.models import AssembleResponse
from ibex_context.shared.wire.protocol import Envelope, pack_header
from tests.helpers import client_clock, http, start_stack

# Admission control off: these tests hold bursts in flight behind a faulty memory service, and
# what admission learns from one fault would refuse part of the next test's burst: the memory gate
# (worker.memgate) lowers its limit, the dispatch rate is cut, the service time a slow fault taught
# makes a fast-degrading burst's slots held (IBEX_ADMISSION_HOLD) and its tail shed on receipt
# (IBEX_ADMISSION_QUEUE_MS), and the adaptive limit shrinks the workers' slots. Each is tested
# under faults where it is the subject: tests/stack/test_memory_admission.py, test_admission_rate.py,
# test_admission.py, test_admission_hold.py.
ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_WORKER_CONCURRENCY": "16", "IBEX_DIRECTIVE_TIMEOUT_MS": "300",
       "IBEX_HOT_TIMEOUT_MS": "600", "IBEX_COLD_TIMEOUT_MS": "600", "IBEX_CONTEXT_TIMEOUT": "800",
       "IBEX_CONTEXT_DEADLINE_MS": "800", "IBEX_MEMORY_ADMISSION": "false", "IBEX_ADMISSION_RATE": "false",
       "IBEX_ADMISSION_QUEUE_MS": "0", "IBEX_ADMISSION_HOLD": "false", "IBEX_ADAPTIVE_LIMIT": "false"}
RESPONSE_SLACK_S = 0.005  # between the client's re-check of the clock and its last clock read
ERROR_SLACK_S = 0.25  # a loaded CI box can stall this process's event loop


def _start(tmp: Path, **kw: Any) -> LocalStack:
    return start_stack(tmp, enable_faults=True, env=ENV, **kw)


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = _start(tmp_path_factory.mktemp("faults"), workers=2)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def stack(shared_stack: LocalStack) -> LocalStack:
    """The module's stack, healed: faults cleared, Redis up, both workers registered."""
    assert http().delete(shared_stack.memory_url + "/_faults", timeout=5).status_code == 200
    if shared_stack.embedded is not None and not shared_stack.embedded.running:
        shared_stack.embedded.start()
    shared_stack.wait_workers(2, 20)
    return shared_stack


def fault(stack: LocalStack, **spec: Any) -> None:
    assert http().put(stack.memory_url + "/_faults", json=spec, timeout=5).status_code == 200


Status = dict[str, Any]


async def _until(c: AsyncClient, what: str, check: Callable[[Status], bool], timeout_s: float = 10.0) -> None:
    """Poll the broker's STATUS on the test's own client until CHECK holds; fail after TIMEOUT_S."""
    end = time.monotonic() + timeout_s
    while not check(await c.status(timeout=1.0)):
        if time.monotonic() > end:
            pytest.fail(f"{what}: not seen within {timeout_s}s")
        await asyncio.sleep(0.005)  # poll interval, not a wait for the event itself


def in_flight(n: int) -> Callable[[Status], bool]:
    return lambda st: st["pending"] >= n


def holds_work(worker_id: str) -> Callable[[Status], bool]:
    return lambda st: st["workers"].get(worker_id, {}).get("inflight", 0) >= 1


async def load(stack: LocalStack, n: int, timeout: float, inject: Callable[[], Any] | None = None,
               when: Callable[[Status], bool] | None = None,
               endpoints: list[str] | None = None) -> collections.Counter[str]:
    """Send n requests at once; once WHEN holds on the broker's STATUS, run INJECT; return outcome counts."""
    async with AsyncClient(endpoints or stack.frontends) as c:
        await c.wait_connected(require_all=False)

        async def one(i: int) -> tuple[str, Any, float]:
            """The outcome and the time to the client's last clock read (``tests.helpers.ClientClock``)."""
            t0 = time.monotonic()
            try:
                r: Any = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o",
                                          query="invoice email", request_id=f"f-{i}", timeout=timeout)
            except IbexError as exc:
                r = exc
            return f"f-{i}", r, clock.last_read() - t0

        with client_clock() as clock:
            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            if inject is not None:
                assert when is not None, "say when to inject"
                await _until(c, "the state to inject the fault in", when)
                await asyncio.to_thread(inject)
            results = await asyncio.gather(*tasks)
    outcomes: collections.Counter[str] = collections.Counter()
    for rid, r, elapsed in results:
        # a response is never handed back after the deadline: the client re-checks the clock (its
        # last read, ClientClock, is that check); an error may surface a little late if the loop stalls
        limit = timeout + (RESPONSE_SLACK_S if isinstance(r, AssembleResponse) else ERROR_SLACK_S)
        assert elapsed <= limit, (rid, r, elapsed)
        if isinstance(r, AssembleResponse):
            assert r.request_id == rid
            outcomes["degraded" if r.degraded else "ok"] += 1
        else:
            outcomes[r.code.value] += 1
    assert sum(outcomes.values()) == n  # exactly one terminal outcome each
    return outcomes


def _stats(stack: LocalStack) -> dict[str, int]:
    st = stack.status()
    assert st is not None
    return dict(st["stats"])


async def test_hung_worker_is_declared_dead_and_its_work_redone(stack: LocalStack) -> None:
    fault(stack, endpoint="search", latency_ms=100)
    victim = stack.workers[0]
    assert victim is not None
    before = _stats(stack)
    outcomes = await load(stack, 60, timeout=4.0, inject=lambda: stack.signal_worker(0, signal.SIGSTOP),
                          when=holds_work("w0"))
    try:
        st = _stats(stack)
        assert st.get("workers_lost", 0) >= 1  # heartbeat expiry (3 x 200 ms)
        assert st.get("redispatched", 0) - before.get("redispatched", 0) >= 1, st  # w0 held work when stopped
        assert outcomes["ok"] + outcomes["degraded"] >= 50, outcomes
    finally:
        stack.signal_worker(0, signal.SIGCONT)

    def woken_and_dropped() -> bool:  # the woken worker's late replies are dropped, never delivered twice
        now = stack.status()
        return (now is not None and "w0" in now["workers"] and now["pending"] == 0
                and now["stats"].get("late_or_unknown_reply", 0) > before.get("late_or_unknown_reply", 0))

    wait_for("w0 back, its late replies dropped and nothing pending", woken_and_dropped, 10)


async def test_broker_restart_ends_inflight_with_errors_then_recovers(stack: LocalStack) -> None:
    fault(stack, endpoint="search", latency_ms=400)
    t0 = time.monotonic()
    outcomes = await load(stack, 30, timeout=3.0, inject=lambda: stack.stop_broker(0), when=in_flight(30))
    assert outcomes == {"UNAVAILABLE": 30}, outcomes  # all in flight on the dead broker: told at once
    assert time.monotonic() - t0 < 3.0  # ...before their deadline
    fault(stack, endpoint="search", latency_ms=0)
    stack.start_broker(0)
    stack.wait_workers(2, 15)  # workers re-announce themselves to the new broker
    again = await load(stack, 20, timeout=3.0)
    assert again["ok"] + again["degraded"] == 20


async def test_redis_stopped_degrades_without_losing_requests(stack: LocalStack) -> None:
    """Redis stopped while requests are in flight: none is lost (load checks one outcome each);
    once it is down, every assembly degrades and none fails. A slow search keeps the burst in
    flight until the stop (a stop after a fixed delay raced the burst: on a fast run all of it
    finished first). The burst fits the workers' slots (2 x 16), so none waits in the broker's
    queue."""
    assert stack.embedded is not None
    fault(stack, endpoint="search", latency_ms=300)
    during = await load(stack, 24, timeout=3.0, inject=stack.embedded.stop, when=in_flight(24))
    assert set(during) <= {"ok", "degraded"}, during
    assert not stack.embedded.running
    fault(stack, endpoint="search", latency_ms=0)
    after = await load(stack, 20, timeout=3.0)
    assert after["degraded"] == 20, after  # the stack fixture restarts Redis for the next test


@pytest.mark.parametrize(
    "spec",
    [{"latency_ms": 2000}, {"status": 500}, {"malformed": True}, {"drop": True}],
    ids=["slow", "erroring", "garbage", "dropping"],
)
async def test_memory_service_faults(stack: LocalStack, spec: dict[str, Any]) -> None:
    fault(stack, endpoint="all", **spec)
    outcomes = await load(stack, 30, timeout=2.0)
    assert outcomes["degraded"] == 30, outcomes  # directive + history, reason recorded


async def test_memory_service_down(stack: LocalStack) -> None:
    assert stack.memory is not None
    stack.memory.kill()
    stack.memory.wait(10)
    try:
        outcomes = await load(stack, 30, timeout=2.0)
    finally:
        stack.start_memory()  # from this thread: PDEATHSIG ties children to the spawning thread
    assert outcomes["degraded"] == 30, outcomes


async def test_two_brokers_one_stopped_service_keeps_answering(tmp_path: Path) -> None:
    stack = _start(tmp_path, workers=2, brokers=2)
    try:
        stack.wait_workers(2, 15)  # every worker is connected to both brokers
        both = await load(stack, 40, timeout=3.0)
        assert both["ok"] + both["degraded"] == 40
        stack.stop_broker(0)
        after = await load(stack, 40, timeout=3.0)
        assert after["ok"] + after["degraded"] == 40, after
        st = stack.status(broker=1)
        assert st is not None and st["stats"].get("replies", 0) >= 40
    finally:
        stack.stop()


async def test_sigterm_drains_inflight_and_exits_zero(stack: LocalStack) -> None:
    fault(stack, endpoint="search", latency_ms=300)
    worker = stack.workers[1]
    assert worker is not None
    before = _stats(stack)
    try:
        outcomes = await load(stack, 20, timeout=4.0, inject=lambda: stack.signal_worker(1, signal.SIGTERM),
                              when=holds_work("w1"))
        assert worker.wait(15) == 0  # finished what it held, then exited cleanly
        assert outcomes["ok"] + outcomes["degraded"] == 20, outcomes  # nothing it held was lost
        # ... and it answered them itself: the broker had nothing to redo
        redone = _stats(stack).get("redispatched", 0) - before.get("redispatched", 0)
        assert redone == 0, f"w1 exited holding {redone} request(s) the broker had sent it; the broker redid them"
    finally:
        stack.workers[1] = stack.start_worker(1)


# ------------------------------------------------------------ a draining worker, the broker played by the test

SLOW_BRANCHES = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "2000",
                 "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_TIMEOUT": "3000",
                 "IBEX_CONTEXT_DEADLINE_MS": "3000"}


def _dispatch(router: zmq.Socket[bytes], worker: bytes, rid: bytes) -> None:
    deadline_ns = time.time_ns() + 10 * 10**9
    payload = msgpack.packb({"v": 1, "request_id": rid.decode(), "org_id": "acme", "agent_id": "support-bot",
                             "model": "gpt-4o", "query": "invoice", "deadline_ns": deadline_ns})
    stamp = P.Stamp(deadline_ns, 0, time.time_ns(), 1).pack()
    header = pack_header(Envelope(rid.decode(), "acme", "support-bot", deadline_ns))
    router.send_multipart([worker, P.TAG, P.REQUEST, b"client", rid, stamp, header, payload])


def _read_until(router: zmq.Socket[bytes], match: Callable[[list[bytes]], bool], answers: dict[bytes, bytes],
                timeout_s: float = 10.0) -> list[bytes] | None:
    """The worker's next frame that MATCHes (None after TIMEOUT_S); REPLY/ERROR frames on the way
    are recorded in ANSWERS by request id."""
    end = time.monotonic() + timeout_s
    while router.poll(max(0, int((end - time.monotonic()) * 1000))):
        frames = router.recv_multipart()
        if frames[2] in (P.REPLY, P.ERROR):
            answers[frames[4]] = frames[2]
        if match(frames):
            return frames
    return None


def _received(frames: list[bytes]) -> int:
    """The worker's ``received`` counter from a HEARTBEAT (0 for any other frame)."""
    if frames[2] != P.HEARTBEAT or len(frames) < 4:
        return 0
    return int(msgpack.unpackb(frames[3])["stats"].get("received", 0))


def test_a_draining_worker_answers_what_reaches_it_during_the_drain(memory: Any, tmp_path: Path) -> None:
    """A request the broker sent before it read the worker's DISCONNECT reaches the worker while it
    drains; the worker must answer it (or refuse it) before exiting, not take it down unanswered.
    The test plays the broker, so the order is exact: A in flight, SIGTERM, DISCONNECT seen, B sent."""
    memory.set_fault("all", latency_ms=800)  # A is still assembling when B arrives
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update({**SLOW_BRANCHES, "IBEX_BROKER_BACKEND": f"tcp://127.0.0.1:{port}", "IBEX_REDIS_URL": memory.redis_url,
                "IBEX_MEMORY_URL": memory.url, "IBEX_MEMORY_SECRET": memory.secret})
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ibex_context.worker", "--worker-id", "dr"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    answers: dict[bytes, bytes] = {}
    try:
        ready = _read_until(router, lambda f: f[2] == P.READY, answers, 30)
        assert ready is not None, (tmp_path / "worker.log").read_text()
        _dispatch(router, ready[0], b"A")
        assert _read_until(router, lambda f: _received(f) >= 1, answers) is not None  # A reached the worker
        proc.send_signal(signal.SIGTERM)
        assert _read_until(router, lambda f: f[2] == P.DISCONNECT, answers) is not None
        assert answers == {}  # A is still in flight: the drain has work to wait for
        _dispatch(router, ready[0], b"B")
        assert proc.wait(15) == 0
        _read_until(router, lambda f: set(answers) >= {b"A", b"B"}, answers, 1.0)
        assert set(answers) == {b"A", b"B"}, f"answered {sorted(answers)} before exiting"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        router.close()
        ctx.term()
