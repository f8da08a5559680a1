"""Fuzzing the broker and a worker over real sockets: typed errors, still serving, bounded memory."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.ops.stack import LocalStack, free_port, wait_for
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import unpack, validate
from ibex_context.shared.wire.models import ErrorReply, UsageReport
from ibex_context.shared.wire.protocol import Envelope, pack_header
from ibex_context.shared.wire.summary_write import SummaryWrite
from tests.helpers import raw_request_frames, start_stack
from tests.properties import examples

ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_MAX_REQUEST_BYTES": "65536"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("fuzz"), seed=False, workers=1, env=ENV)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def dealer(stack: LocalStack) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.frontend)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def _valid(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"v": 1, "request_id": "fz", "org_id": "acme", "agent_id": "bot", "model": "gpt-4o",
                            "query": "q", "deadline_ns": time.time_ns() + 5 * 10**9}
    base.update(over)
    return base


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
payloads = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.dictionaries(st.sampled_from(list(_valid())), json_values, max_size=8).map(
        lambda d: msgpack.packb({**_valid(), **d}, use_bin_type=True)),
    st.sampled_from(["v", "org_id", "agent_id", "deadline_ns", "recent_messages", "options", "tool_schemas"]).flatmap(
        lambda k: json_values.map(lambda v: msgpack.packb(_valid(**{k: v}), use_bin_type=True))),
)
messages = st.one_of(
    payloads.map(raw_request_frames),
    st.lists(st.binary(max_size=40), min_size=1, max_size=6),
    st.tuples(st.binary(max_size=8), payloads).map(lambda t: [P.TAG, t[0], t[1]]),
)


def _roundtrip(sock: zmq.Socket[bytes], msg: list[bytes]) -> list[list[bytes]]:
    sock.send_multipart(msg)
    replies = []
    if sock.poll(5000):
        replies.append(sock.recv_multipart())
    while sock.poll(30):  # anything extra would be a second answer
        replies.append(sock.recv_multipart())
    return replies


def _unanswered(msg: list[bytes]) -> bool:
    """A well-formed usage report or summary: forwarded to a worker, with no reply by design."""
    if len(msg) != 3 or msg[0] != P.TAG or msg[1] not in (P.USAGE, P.SUMMARY):
        return False
    model = UsageReport if msg[1] == P.USAGE else SummaryWrite
    return not isinstance(validate(unpack(msg[2]), model), ErrorReply)


HOUR_AHEAD = time.time_ns() + 3600 * 10**9


@settings(max_examples=examples(250), suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
          deadline=None)
@given(msg=messages)
@example(msg=[P.TAG, P.USAGE, msgpack.packb(_valid(deadline_ns=HOUR_AHEAD))])  # a request sent as a report
@example(msg=[P.TAG, P.SUMMARY, msgpack.packb(_valid(deadline_ns=HOUR_AHEAD))])
def test_broker_answers_every_message_exactly_once(dealer: zmq.Socket[bytes], msg: list[bytes]) -> None:
    replies = _roundtrip(dealer, msg)
    if _unanswered(msg):
        assert replies == [], (msg, replies)
        return
    assert len(replies) == 1, (msg, replies)
    tag, kind, _rid, body = replies[0]
    assert tag == P.TAG and kind in (P.REPLY, P.ERROR)
    decoded = msgpack.unpackb(body)
    if kind == P.ERROR:
        assert decoded["code"] in {"INVALID_REQUEST", "DEADLINE_EXCEEDED", "OVERLOADED", "UNAVAILABLE"}
        assert decoded["message"]


def _random_message(rng: random.Random) -> list[bytes]:
    """Cheap seeded garbage for the long run (hypothesis drives the exploratory test above)."""
    kind = rng.randrange(4)
    if kind == 0:
        return raw_request_frames(rng.randbytes(rng.randrange(300)))
    if kind == 1:
        return [rng.randbytes(rng.randrange(1, 20)) for _ in range(rng.randrange(1, 6))]
    field = rng.choice(list(_valid()))
    value = rng.choice([None, -1, math.nan, math.inf, "x" * rng.randrange(50), [[[[1]]]], {"a": b"\xff"}, 2**64 - 1])
    body = msgpack.packb(_valid(**{field: value}) if kind == 2 else [value, field], use_bin_type=True)
    return raw_request_frames(body)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_long_fuzz_run_keeps_memory_bounded_and_service_alive(stack: LocalStack, dealer: zmq.Socket[bytes]) -> None:
    assert stack.broker is not None
    examples = [_random_message(random.Random(i)) for i in range(150)]
    for m in examples[:50]:  # warm up allocator pools
        _roundtrip(dealer, m)
    before = _rss_kib(stack.broker.pid)
    sent = 0
    for _ in range(20):
        for m in examples:
            dealer.send_multipart(m)
            sent += 1
        got = 0
        while got < len(examples) and dealer.poll(5000):
            dealer.recv_multipart()
            got += 1
        assert got == len(examples)
    after = _rss_kib(stack.broker.pid)
    assert after - before < 16 * 1024, f"broker RSS {before} KiB -> {after} KiB after {sent} fuzz messages"
    # giant message: over the frontend's ZMQ_MAXMSGSIZE (twice the request limit), so it costs its
    # sender the connection (docs/assembly.md "Size limits"); the broker keeps serving others
    big = raw_request_frames(msgpack.packb(_valid(query="x" * 200_000)))
    ctx = zmq.Context()
    other = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    monitor = other.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    other.connect(stack.frontend)
    try:
        other.send_multipart(big)
        assert monitor.poll(10_000), "the broker kept the connection of a message over ZMQ_MAXMSGSIZE"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert other.poll(0) == 0  # and answered nothing
    finally:
        monitor.close()
        other.close()
        ctx.term()
    replies = _roundtrip(dealer, raw_request_frames(msgpack.packb(_valid(request_id="after-fuzz"))))
    assert len(replies) == 1 and replies[0][1] == P.REPLY, replies
    assert msgpack.unpackb(replies[0][3])["request_id"] == "after-fuzz"


def _answers(router: zmq.Socket[bytes], want: int, timeout_s: float = 10.0) -> dict[bytes, list[bytes]]:
    """Collect the worker's REPLY/ERROR frames by request id until WANT arrived or TIMEOUT_S passed."""
    got: dict[bytes, list[bytes]] = {}
    end = time.monotonic() + timeout_s
    while len(got) < want and router.poll(max(0, int((end - time.monotonic()) * 1000))):
        frames = router.recv_multipart()
        if frames[2] in (P.REPLY, P.ERROR):
            got[frames[4]] = frames
    return got


def test_worker_survives_malformed_frames(tmp_path: Path) -> None:
    """Play the broker: a real worker process gets garbage and still answers a valid request."""
    redis = EmbeddedRedis()
    redis.start()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update({"IBEX_BROKER_BACKEND": f"tcp://127.0.0.1:{port}", "IBEX_REDIS_URL": redis.url,
                "IBEX_MEMORY_URL": f"http://127.0.0.1:{free_port()}", "IBEX_HEARTBEAT_INTERVAL_MS": "200"})
    log = open(tmp_path / "worker.log", "wb")  # the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "ibex_context.worker", "--worker-id", "fz"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()
    try:
        ident: list[bytes] = []

        def ready() -> bool:
            if router.poll(100):
                frames = router.recv_multipart()
                if frames[2] in (P.READY, P.HEARTBEAT):
                    ident.append(frames[0])
            return bool(ident)

        wait_for("worker READY", ready, 30, tmp_path / "worker.log")
        w = ident[0]
        stamp = P.Stamp(time.time_ns() + 5 * 10**9, 0, time.time_ns(), 1).pack()
        def framed(rid: str, payload: bytes | None = None, **over: Any) -> list[bytes]:
            """header + payload of one request; ``payload`` replaces the valid one the header was made from."""
            v = _valid(request_id=rid, **over)
            head = pack_header(Envelope(rid, v["org_id"], v["agent_id"], v["deadline_ns"]))
            return [head, msgpack.packb(v) if payload is None else payload]

        garbage: list[list[bytes]] = [
            [w, P.TAG, P.REQUEST, b"c", b"r1", b"\xc1", *framed("r1")],  # bad stamp
            [w, P.TAG, P.REQUEST, b"c", b"r2", stamp, *framed("r2", b"\xc1\xc1")],  # bad msgpack
            [w, P.TAG, P.REQUEST, b"c", b"r3", stamp, *framed("r3", v=7)],  # unknown version
            [w, P.TAG, P.REQUEST, b"c", b"r4", stamp, *framed("r4", query=math.nan)],
            [w, P.TAG, P.REQUEST, b"c", b"r5", stamp, *framed("r5", msgpack.packb({"deep": [[[[[[[[[[[[1]]]]]]]]]]]]}))],  # noqa: E501
            [w, P.TAG, P.REQUEST, b"c", b"r6", stamp, b"\x01short", msgpack.packb(_valid(request_id="r6"))],
        ]
        for g in garbage:
            router.send_multipart(g)
        for junk in ([w, b"nope"], [w, P.TAG], [w, P.TAG, b"\x7f", b"x"], [w, P.TAG, P.REQUEST, b"too", b"few"]):
            router.send_multipart(junk)  # not request-shaped: ignored and counted
        errors = {rid: (f[2], msgpack.unpackb(f[5])["code"]) for rid, f in _answers(router, len(garbage)).items()}
        invalid = (P.ERROR, "INVALID_REQUEST")
        assert errors == {b"r1": (P.ERROR, "INTERNAL"), b"r2": invalid, b"r3": invalid, b"r4": invalid, b"r5": invalid,
                          b"r6": invalid}
        router.send_multipart([w, P.TAG, P.REQUEST, b"c", b"ok", stamp, *framed("ok")])
        reply = _answers(router, 1).get(b"ok")
        assert reply is not None and reply[2] == P.REPLY  # degraded (no memory service), but served
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
        router.close()
        ctx.term()
        redis.close()
