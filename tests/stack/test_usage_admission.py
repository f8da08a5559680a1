"""Admission for usage reports (broker/usage_limits.py, broker/usage.py): token buckets per caller
key, per org and in total, reports shed while requests wait for a worker, every report counted
under one outcome and a key over its limit told OVERLOADED once a second.

The rules alone; the real broker (its own thread, real ZeroMQ sockets) in front of a worker that
counts what it is sent; and the real stack (Redis, memory service, broker, two workers) with one
org flooding reports from several processes while another org assembles.

Here: the checks through running servers; the pure parts are in
tests/unit/test_usage_admission.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from ibex_context.broker.broker import Broker
from ibex_context.client.client import AsyncClient
from ibex_context.client.usage import USAGE_ID_PREFIX
from ibex_context.ops.local import LocalStack
from ibex_context.shared.config.settings import BrokerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import decode_reply, encode
from ibex_context.shared.wire.errors import ErrorCode
from ibex_context.shared.wire.models import ErrorReply, UsageReport
from tests.helpers import eventually, start_stack
from tests.unit.test_usage_admission import S

pytestmark = pytest.mark.timeout(240)
MODEL = "mistral-small-3"
PLACEHOLDER = "Z" * 16  # not hex: found once in the encoded report, replaced by each report's number


def report_template(org: str) -> tuple[bytes, bytes]:
    """(head, tail) of an encoded report whose request_id ends in PLACEHOLDER: head + 16 hex + tail
    is a report with its own id, built at the cost of a concatenation."""
    payload = encode(UsageReport(request_id=f"{USAGE_ID_PREFIX}{PLACEHOLDER}", org_id=org, agent_id="bot",
                                 deadline_ns=time.time_ns() + 600 * S, assembly_id=secrets.token_hex(16),
                                 model=MODEL, estimated_tokens=100, prompt_tokens=100))
    head, tail = payload.split(PLACEHOLDER.encode())
    return head, tail


def report(org: str, n: int) -> bytes:
    head, tail = report_template(org)
    return head + b"%016x" % n + tail


# ----------------------------------------------------- the real broker, a worker that counts


class CountingWorker(threading.Thread):
    """A DEALER worker: READY with ``capacity``; counts the reports it is sent; holds every request
    until ``release`` is set, then answers them all (a minimal error reply: the client only needs
    one reply)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, capacity: int) -> None:
        super().__init__(daemon=True)
        self.ctx, self.backend, self.capacity = ctx, backend, capacity
        self.reports: list[bytes] = []
        self.held: list[P.Dispatch] = []
        self.release = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.backend)
        info = P.Info(self.capacity, "w0", os.getpid())
        s.send_multipart(P.ready_frames(info))
        last_hb = time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() - last_hb > 0.05:
                s.send_multipart(P.heartbeat_frames(info))
                last_hb = time.monotonic()
            if self.release.is_set():
                for d in self.held:
                    body = encode(ErrorReply(request_id="-", code=ErrorCode.INTERNAL, message="held"))
                    s.send_multipart(P.worker_reply_frames(P.ERROR, d.client, d.request_id, body, P.Feedback(False, 0)))
                self.held.clear()
            if not s.poll(1):
                continue
            msg = P.parse_broker_message(s.recv_multipart())
            if isinstance(msg, P.UsageMessage):
                self.reports.append(msg.payload)
            elif isinstance(msg, P.Dispatch):
                self.held.append(msg)
        s.close(linger=0)


@contextlib.contextmanager
def broker_with(capacity: int = 4, **settings: Any) -> Iterator[tuple[Broker, CountingWorker, zmq.Context[Any]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    broker = Broker(settings=BrokerSettings(heartbeat_interval_ms=100, **settings),
                    frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", ctx=ctx)
    thread = threading.Thread(target=broker.serve_forever, daemon=True)
    thread.start()
    worker = CountingWorker(ctx, broker.backend_endpoint, capacity)
    worker.start()
    try:
        end = time.monotonic() + 10
        while not broker.table:
            assert time.monotonic() < end, "the worker did not register"
            time.sleep(0.01)
        yield broker, worker, ctx
    finally:
        worker.stop.set()
        worker.join(5)
        broker.stop()
        thread.join(5)
        ctx.term()


def connect(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def replies_until_status(s: zmq.Socket[Any]) -> list[P.Reply]:
    """Every reply to what ``s`` sent so far: a STATUS request is answered after them (one pipe,
    read in order), so what comes before its answer is all there is."""
    s.send_multipart(P.status_request_frames())
    got: list[P.Reply] = []
    while True:
        assert s.poll(5000), "no STATUS reply"
        reply = P.parse_reply(s.recv_multipart())
        if isinstance(reply, P.StatusReply):
            return got
        got.append(reply)


def overloaded_ids(replies: list[P.Reply]) -> list[str]:
    ids = []
    for r in replies:
        err = decode_reply(r.payload)
        assert isinstance(err, ErrorReply) and err.code == ErrorCode.OVERLOADED, err
        assert err.request_id == r.correlation_id
        ids.append(r.correlation_id)
    return ids


def usage_outcomes(stats: dict[str, int]) -> int:
    """Reports counted under an outcome: every report the broker receives is under exactly one."""
    return sum(n for k, n in stats.items() if k == "usage_forwarded"
               or k.startswith(("usage_shed_", "usage_rejected_", "usage_dropped_", "usage_expired_")))


async def test_a_key_over_its_limit_is_shed_counted_and_told_once() -> None:
    with broker_with(usage_rate_per_key=1.0, usage_burst_s=10.0, usage_rate_per_org=0, usage_rate_total=0) as (
            broker, worker, ctx):
        s = connect(ctx, broker.frontend_endpoint)
        for n in range(30):
            s.send_multipart(P.usage_frames(report("acme", n)))
        told = overloaded_ids(replies_until_status(s))
        await eventually("the burst forwarded", lambda: len(worker.reports) >= 10)
        assert told == [f"{USAGE_ID_PREFIX}{10:016x}"]  # the first shed, and only it, is answered
        assert broker.stats["usage_forwarded"] == 10 and broker.stats["usage_shed_key"] == 20
        assert broker.stats["usage_overloaded_replies"] == 1
        other = connect(ctx, broker.frontend_endpoint)  # another connection is another caller
        other.send_multipart(P.usage_frames(report("acme", 99)))
        assert replies_until_status(other) == []
        await eventually("the other caller's report forwarded", lambda: len(worker.reports) == 11)
        assert usage_outcomes(broker.stats) == broker.stats["usage_received"] == 31
        s.close()
        other.close()


async def test_an_org_over_its_limit_is_shed_and_another_org_is_not() -> None:
    with broker_with(usage_rate_per_key=0, usage_rate_per_org=1.0, usage_burst_s=10.0, usage_rate_total=0) as (
            broker, worker, ctx):
        a1, a2, g = (connect(ctx, broker.frontend_endpoint) for _ in range(3))
        for n in range(8):
            a1.send_multipart(P.usage_frames(report("acme", n)))
        assert replies_until_status(a1) == []
        for n in range(8, 16):  # the same org from another connection: 2 in the bucket, 6 shed
            a2.send_multipart(P.usage_frames(report("acme", n)))
        for n in range(10):
            g.send_multipart(P.usage_frames(report("globex", n)))
        assert len(overloaded_ids(replies_until_status(a2))) == 1
        assert replies_until_status(g) == []
        await eventually("20 reports forwarded", lambda: len(worker.reports) == 20)
        assert broker.stats["usage_shed_org"] == 6 and broker.stats["usage_forwarded"] == 20
        for s in (a1, a2, g):
            s.close()


async def test_the_total_limit_holds_many_orgs() -> None:
    with broker_with(usage_rate_per_key=0, usage_rate_per_org=0, usage_rate_total=1.0, usage_burst_s=5.0) as (
            broker, worker, ctx):
        s = connect(ctx, broker.frontend_endpoint)
        for n in range(20):
            s.send_multipart(P.usage_frames(report(f"org-{n}", n)))
        assert len(overloaded_ids(replies_until_status(s))) == 1
        await eventually("5 reports forwarded", lambda: len(worker.reports) == 5)
        assert broker.stats["usage_shed_total"] == 15
        s.close()


async def test_reports_are_shed_while_requests_wait_for_a_worker() -> None:
    """Assemblies first: with the worker's credit taken and a request waiting, a report is shed;
    once the requests are answered, reports flow again."""
    with broker_with(capacity=1, adaptive_limit=False) as (broker, worker, ctx):
        async with AsyncClient(broker.frontend_endpoint) as c:
            await c.wait_connected()
            fields = {"org_id": "globex", "agent_id": "bot", "model": "gpt-4o", "query": "q", "timeout": 10.0}
            calls = [asyncio.create_task(c.assemble(request_id=f"r{i}", **fields)) for i in range(2)]
            await eventually("one request held, one waiting", lambda: len(worker.held) == 1 and len(broker.queue) == 1)
            s = connect(ctx, broker.frontend_endpoint)
            s.send_multipart(P.usage_frames(report("acme", 1)))
            assert len(overloaded_ids(replies_until_status(s))) == 1
            assert broker.stats["usage_shed_busy"] == 1 and not worker.reports
            worker.release.set()
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            s.send_multipart(P.usage_frames(report("acme", 2)))
            assert replies_until_status(s) == []
            await eventually("the report forwarded", lambda: len(worker.reports) == 1)
            s.close()


# ------------------------------------------------------------------------------ the real stack

# Retrieval timeouts and deadlines with room for a shared two-CPU test machine: the assertion is
# that a flood does not cost another org its answers, not how fast an idle stack is.
STACK_ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "600", "IBEX_HOT_TIMEOUT_MS": "1200", "IBEX_COLD_TIMEOUT_MS": "1200",
             "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_HEARTBEAT_INTERVAL_MS": "200"}
TIMEOUT_S = 2.0
FLOODERS = 3
ASSEMBLIES = 250


def flood(endpoint: str, org: str, index: int, ready: Any, go: Any, stop: Any, out: Any) -> None:
    """One flooding caller (its own process and connection): from ``go`` until ``stop``, reports,
    each with its own id (``index`` first), as fast as the socket takes them; then every reply
    the broker sent it."""
    # The flooders share this machine's CPUs with the stack, which a remote caller would not:
    # below the stack's priority they still send as fast as the broker takes their reports, but
    # what the test measures is the broker's admission, not the scheduler.
    os.nice(10)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = connect(ctx, endpoint)
    result: tuple[int, list[str]] | str = "did not connect"
    try:
        replies_until_status(s)  # connected
        head, tail = report_template(org)
        ready.release()
        go.wait()
        sent, replies = 0, []
        while not stop.is_set():
            for _ in range(256):
                s.send_multipart([P.TAG, P.USAGE, head + b"%02x%014x" % (index, sent) + tail])
                sent += 1
            with contextlib.suppress(zmq.Again):
                while True:
                    replies.append(s.recv_multipart(zmq.NOBLOCK))
        result = f"sent {sent}, then no reply to STATUS"
        parsed = [P.parse_reply(f) for f in replies]
        result = (sent, overloaded_ids([r for r in parsed if isinstance(r, P.Reply)])
                  + overloaded_ids(replies_until_status(s)))
    except (AssertionError, zmq.ZMQError) as exc:
        result = f"{result}: {exc!r}"
    finally:
        out.put(result)
        s.close()
        ctx.term()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("usage-flood"), workers=2, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()


async def _assemble_all(c: AsyncClient) -> list[tuple[str, float]]:
    """ASSEMBLIES of globex's, two at a time, each followed by its usage report; after ten bad
    outcomes the rest are not run (the test has failed, and each could take its whole timeout)."""
    sem = asyncio.Semaphore(2)
    bad = 0

    async def one(i: int) -> tuple[str, float]:
        nonlocal bad
        async with sem:
            if bad >= 10:
                return "not run", 0.0
            t0 = time.monotonic()
            try:
                resp = await c.assemble(org_id="globex", agent_id="support-bot", model=MODEL, query="invoice october",
                                        format="openai", timeout=TIMEOUT_S,
                                        messages=[{"role": "user", "content": "Which invoice did I get in October?"}])
            except Exception as exc:  # any failure is an outcome to report, not a crash of the run
                bad += 1
                return type(exc).__name__, time.monotonic() - t0
            elapsed = time.monotonic() - t0
            c.report_usage(resp, prompt_tokens=resp.prompt_tokens_uncalibrated or 1)
            bad += resp.degraded or elapsed > TIMEOUT_S
            return ("degraded: " + ", ".join(resp.degraded_reasons)) if resp.degraded else "ok", elapsed

    return await asyncio.gather(*(one(i) for i in range(ASSEMBLIES)))


async def test_one_orgs_usage_flood_leaves_another_orgs_assemblies_whole_and_on_time(stack: LocalStack) -> None:
    """acme floods reports from FLOODERS processes as fast as they can send; globex assembles
    meanwhile (and reports its usage). Every globex assembly is undegraded and on time, none of
    globex's reports is shed, and acme's excess is shed and counted: every report the broker
    received is under exactly one outcome, and each flooder heard OVERLOADED about once a
    second, never twice for one report."""
    limits = BrokerSettings()
    before = (stack.status(2.0) or {}).get("stats", {})
    mp = multiprocessing.get_context("spawn")
    ready, go, stop, out = mp.Semaphore(0), mp.Event(), mp.Event(), mp.Queue()
    procs = [mp.Process(target=flood, args=(stack.frontend, "acme", i, ready, go, stop, out), daemon=True)
             for i in range(FLOODERS)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            assert ready.acquire(timeout=60), "a flooder did not connect"
        async with AsyncClient(stack.frontend) as c:
            await c.wait_connected()
            go.set()
            t0 = time.monotonic()
            results = await _assemble_all(c)
            assembled_s = time.monotonic() - t0
            stop.set()
            floods = [out.get(timeout=30) for _ in procs]  # each after the broker read all it sent
            flood_s = time.monotonic() - t0
            reported = c.stats["usage_sent"]
            refused = c.stats["usage_refused"]
    finally:
        go.set()
        stop.set()
        for p in procs:
            p.join(30)
    bad = [r for r in results if r[0] != "ok" or r[1] > TIMEOUT_S]
    status = stack.status(5.0) or {}
    assert not bad, (f"{len(bad)} of {ASSEMBLIES} globex assemblies degraded, failed or late: {bad[:10]}; "
                     f"broker: {status.get('stats')}")
    assert reported == ASSEMBLIES and refused == 0  # none of globex's reports was shed
    assert all(isinstance(f, tuple) for f in floods), floods

    sent = sum(n for n, _ in floods)
    assert sent > 10 * limits.usage_rate_per_org * flood_s, f"not a flood: {sent} reports in {flood_s:.1f} s"
    assert assembled_s < flood_s

    def counters() -> dict[str, int]:
        status = stack.status(5.0)
        assert status is not None
        return {k: n - before.get(k, 0) for k, n in status["stats"].items()}

    stats: dict[str, int] = {}

    def all_received() -> bool:
        stats.update(counters())
        return stats["usage_received"] >= sent + reported

    await eventually("every report received by the broker", all_received, timeout_s=10)
    assert stats["usage_received"] == sent + reported  # nothing lost on the way
    assert usage_outcomes(stats) == stats["usage_received"], stats
    shed = sum(n for k, n in stats.items() if k.startswith("usage_shed_"))
    allowed = limits.usage_rate_per_org * (flood_s + limits.usage_burst_s + 1)
    assert stats["usage_forwarded"] <= allowed + reported, (stats, allowed)
    assert shed >= sent - allowed, stats
    told = [i for _, ids in floods for i in ids]
    assert len(told) == len(set(told)) == stats["usage_overloaded_replies"]  # none answered twice
    for _, ids in floods:
        assert 1 <= len(ids) <= flood_s + 3, len(ids)


def test_a_malformed_report_is_answered_by_the_broker_once_on_one_line(stack: LocalStack) -> None:
    """A report that is not a UsageReport (an extra key holding a newline and a log line, a request
    sent as a report) is answered INVALID_REQUEST by the broker, once each, naming the key quoted on
    one line; it never reaches a worker, which would drop it without a word."""
    forged = "2099-01-01 00:00:00 INFO forged: an operator would believe this"
    doc = {"v": 1, "request_id": f"{USAGE_ID_PREFIX}x", "org_id": "initech", "agent_id": "bot",
           "deadline_ns": time.time_ns() + 60 * S, "assembly_id": "a" * 32, "model": MODEL,
           "estimated_tokens": 1, "prompt_tokens": 1, f"x\n{forged}": 1}
    request = {"v": 1, "request_id": f"{USAGE_ID_PREFIX}req", "org_id": "initech", "agent_id": "bot",
               "model": "gpt-4o", "query": "q", "deadline_ns": time.time_ns() + 60 * S}
    payloads = []
    for n in range(20):
        doc["request_id"] = f"{USAGE_ID_PREFIX}{n}"
        payloads.append(msgpack.packb(doc))
    payloads.append(msgpack.packb(request))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = connect(ctx, stack.frontend)
    before = (stack.status(2.0) or {})["stats"].get("usage_rejected_invalid", 0)
    for p in payloads:
        s.send_multipart(P.usage_frames(p))
    replies = replies_until_status(s)
    s.close()
    ctx.term()
    errors = [decode_reply(r.payload) for r in replies]
    assert sorted(r.correlation_id for r in replies) == sorted(msgpack.unpackb(p)["request_id"] for p in payloads)
    for err in errors:
        assert isinstance(err, ErrorReply) and err.code == ErrorCode.INVALID_REQUEST, err
        assert "\n" not in err.message
    assert {e.field for e in errors if isinstance(e, ErrorReply)} == {repr(f"x\n{forged}"), "assembly_id"}
    assert (stack.status(2.0) or {})["stats"].get("usage_rejected_invalid", 0) - before == len(payloads)


def test_refused_reports_are_summed_in_the_log_and_cannot_forge_a_line(stack: LocalStack) -> None:
    """A well-formed report naming an assembly this service never issued (its id holding a newline
    and a log line): refused by the worker, counted, and logged as one escaped summary, not one line
    (or two) per report."""
    forged = "2099-01-01 00:00:00 INFO forged: an operator would believe this"
    doc = {"v": 1, "request_id": f"{USAGE_ID_PREFIX}x", "org_id": "initech", "agent_id": "bot",
           "deadline_ns": time.time_ns() + 60 * S, "assembly_id": f"x\n{forged}", "model": MODEL,
           "estimated_tokens": 1, "prompt_tokens": 1}
    payloads = []
    for n in range(200):  # under the key's burst: every one reaches a worker
        doc["request_id"] = f"{USAGE_ID_PREFIX}{n}"
        payloads.append(msgpack.packb(doc))

    def refused() -> int:
        st = stack.status(2.0)
        return sum(w["stats"].get("usage_unknown_assembly", 0) for w in st["workers"].values()) if st else 0

    start = refused()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = connect(ctx, stack.frontend)
    for p in payloads:
        s.send_multipart(P.usage_frames(p))
    assert replies_until_status(s) == []
    s.close()
    ctx.term()
    end = time.monotonic() + 15
    while refused() - start < len(payloads):
        assert time.monotonic() < end, "the workers did not count the refused reports"
        time.sleep(0.05)

    def logs() -> str:
        return "".join(Path(stack.log_dir, f"worker-{i}.log").read_text(errors="replace") for i in range(2))

    time.sleep(0.3)  # a flush interval: what the workers log about these reports is written
    text = logs()
    assert not [line for line in text.splitlines() if line.startswith("2099-")], "a report wrote its own log line"
    assert len(re.findall("usage report", text)) <= 4, text[-2000:]
    while not re.search(r"usage reports refused: unknown_assembly \d+", text := logs()):
        assert time.monotonic() < end, f"no summary of the refused reports in the workers' logs: {text[-2000:]}"
        time.sleep(0.05)
    assert "\\n2099-01-01" in text  # the caller's text quoted, its newline escaped
