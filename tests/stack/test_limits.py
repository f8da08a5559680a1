"""Size limits on the real stack: no caller's message size can cost a worker, a connection or a
neighbour's request, and the broker's books (pending, in flight) always return to zero.

Oversized requests are sent through raw DEALER sockets (what a foreign or hostile client does): the
client library refuses them before the socket, so it cannot show what the broker does with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack, wait_for
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import decode_reply
from ibex_context.shared.wire.errors import ErrorCode, InvalidRequest
from ibex_context.shared.wire.models import AssembleResponse, ErrorReply
from tests.helpers import raw_request_frames, start_stack
from tests.stack.test_main_job import FAST_HEARTBEAT

MIB = 1 << 20
REPLY_LIMIT = 256 << 10  # small, so a modest history fills a reply past it


def _request(rid: str, history_bytes: int = 0, *, timeout_s: float = 5.0, messages: int = 10) -> dict[str, Any]:
    per = history_bytes // messages if history_bytes else 0
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": ("word " * (per // 5 + 1))[:per]}
               for i in range(messages)] if per else [{"role": "user", "content": "hello"}]
    return {"request_id": rid, "org_id": "acme", "agent_id": "support-bot", "model": "gpt-4.1",
            "query": "invoice email preferences", "recent_messages": history,
            "deadline_ns": time.time_ns() + int(timeout_s * 1e9)}


def _pack(doc: dict[str, Any]) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # 1 MiB requests (the default is sized for the catalog's largest window): these tests are about
    # what the limits do, not their defaults
    env = {**FAST_HEARTBEAT, "IBEX_MAX_REQUEST_BYTES": str(MIB), "IBEX_MAX_REPLY_BYTES": str(REPLY_LIMIT)}
    s = start_stack(tmp_path_factory.mktemp("limits"), workers=2, env=env)
    try:
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def stopping(stack: LocalStack) -> Iterator[LocalStack]:
    try:
        yield stack
    finally:
        stack.stop()


def _stats(stack: LocalStack) -> dict[str, Any]:
    st = stack.status(2.0)
    assert st is not None, "broker did not answer STATUS"
    return st


def _books_empty(stack: LocalStack) -> bool:
    st = stack.status(1.0)
    return st is not None and st["pending"] == 0 and st["queue_depth"] == 0 and all(
        w["inflight"] == 0 for w in st["workers"].values()) and len(st["workers"]) == 2


class RawClient:
    """A bare DEALER on the broker frontend: sends any bytes, collects replies by request id."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def send(self, payload: bytes) -> None:
        await self.sock.send_multipart(raw_request_frames(payload))

    async def replies(self, n: int, timeout_s: float) -> dict[str, AssembleResponse | ErrorReply]:
        out: dict[str, AssembleResponse | ErrorReply] = {}
        async with asyncio.timeout(timeout_s):
            while len(out) < n:
                frames = await self.sock.recv_multipart()
                assert len(frames) == 4 and frames[0] == P.TAG, frames[:2]
                out[frames[2].decode()] = decode_reply(frames[3])
        return out

    def close(self) -> None:
        self.sock.close(0)


async def test_burst_around_an_oversized_request_on_one_connection(stack: LocalStack) -> None:
    """8 normal requests and one 1.2 MB request on the same connection: the 8 succeed, the big one
    gets INVALID_REQUEST naming its size and the limit, and no connection or worker is lost."""
    before = _stats(stack)["stats"]
    ctx = zmq.asyncio.Context()
    raw = RawClient(ctx, stack.frontend)
    try:
        ids = [f"n-{uuid.uuid4().hex[:8]}" for _ in range(8)]
        big_id = f"big-{uuid.uuid4().hex[:8]}"
        big = _pack(_request(big_id, int(1.2 * MIB)))
        assert MIB < len(big) < P.frontend_max_msgsize(MIB)
        for i, rid in enumerate(ids):
            await raw.send(_pack(_request(rid)))
            if i == 3:
                await raw.send(big)
        got = await raw.replies(9, 30.0)
    finally:
        raw.close()
        ctx.term()
    for rid in ids:
        assert isinstance(got[rid], AssembleResponse), got[rid]
    err = got[big_id]
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.INVALID_REQUEST
    assert str(len(big)) in err.message and str(MIB) in err.message, err.message
    after = _stats(stack)["stats"]
    assert after.get("workers_lost", 0) == before.get("workers_lost", 0)
    wait_for("broker books back to zero", lambda: _books_empty(stack), 10.0)


async def test_message_over_twice_the_limit_costs_only_its_sender(stack: LocalStack) -> None:
    """Beyond the frontend's message-size cap libzmq drops the sender's connection; another client's
    requests on its own connection, sent at the same time, are untouched."""
    ctx = zmq.asyncio.Context()
    hostile = RawClient(ctx, stack.frontend)
    try:
        async with AsyncClient(stack.frontend) as c:
            await c.wait_connected()
            huge = b"\x00" * (P.frontend_max_msgsize(MIB) + 1)
            await hostile.send(huge)
            outs = await asyncio.gather(*[c.assemble(timeout=5.0, **{k: v for k, v in _request(f"ok-{i}").items()
                                                                      if k not in ("request_id", "deadline_ns")})
                                          for i in range(6)])
            assert all(isinstance(o, AssembleResponse) for o in outs)
            assert c.stats["disconnects"] == 0
    finally:
        hostile.close()
        ctx.term()
    assert _stats(stack)["stats"].get("workers_lost", 0) == 0
    wait_for("broker books back to zero", lambda: _books_empty(stack), 10.0)


async def test_reply_over_the_limit_is_a_typed_error_and_no_worker_is_lost(stack: LocalStack) -> None:
    """A request under the request limit whose reply (history twice, plus the rest) would exceed
    IBEX_MAX_REPLY_BYTES: the worker answers INVALID_REQUEST instead of sending it."""
    before = _stats(stack)["stats"]
    async with AsyncClient(stack.frontend) as c:
        req = _request("x", REPLY_LIMIT // 2 + 16_384)
        fields = {k: v for k, v in req.items() if k not in ("request_id", "deadline_ns")}
        with pytest.raises(InvalidRequest) as info:
            await c.assemble(timeout=10.0, **fields)
        assert "reply" in info.value.message and str(REPLY_LIMIT) in info.value.message
        # and the stack keeps serving at once, on every worker
        outs = await asyncio.gather(*[c.assemble(timeout=5.0, **{**fields, "recent_messages": []})
                                      for _ in range(8)])
        assert {o.worker_id for o in outs} <= {"w0", "w1"} and all(o.rendered for o in outs)
    after = _stats(stack)["stats"]
    assert after.get("workers_lost", 0) == before.get("workers_lost", 0)
    assert after.get("backend_disconnects", 0) == before.get("backend_disconnects", 0)
    wait_for("broker books back to zero", lambda: _books_empty(stack), 10.0)


async def test_large_history_under_the_limits_is_answered(tmp_path: Path) -> None:
    """~565 KB of history in 10 messages (the observed case): with the default limits the reply
    (history twice) fits, the request is answered, no worker is lost."""
    s = start_stack(tmp_path, workers=1, env=FAST_HEARTBEAT)
    try:
        async with AsyncClient(s.frontend) as c:
            req = _request("x", 565_000)
            fields = {k: v for k, v in req.items() if k not in ("request_id", "deadline_ns")}
            resp = await c.assemble(timeout=20.0, **fields)
            assert resp.budget.messages_tokens > 50_000
        st = s.status(2.0)
        assert st is not None and st["stats"].get("workers_lost", 0) == 0 and st["pending"] == 0
    finally:
        s.stop()


class RogueWorker:
    """A bare DEALER on the broker backend that announces credit and heartbeats but never replies."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"rogue.0001")
        self.sock.connect(endpoint)
        self.info = P.Info(1, "rogue", 1).pack()
        self.sock.send_multipart([P.TAG, P.READY, self.info])

    def pump(self, until: float) -> list[list[bytes]]:
        """Heartbeat (so it stays alive) and collect requests until ``until`` (monotonic)."""
        got: list[list[bytes]] = []
        while time.monotonic() < until:
            self.sock.send_multipart([P.TAG, P.HEARTBEAT, self.info])
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                if frames[1] == P.REQUEST:
                    got.append(frames)
        return got


@contextlib.contextmanager
def rogue_stack(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[LocalStack, RogueWorker, zmq.Socket[Any]]]:
    """A broker with no real worker, one RogueWorker the broker has registered, and a raw client."""
    with stopping(start_stack(tmp_path, workers=0, env=env, seed=False)) as s:
        ctx: zmq.Context[Any] = zmq.Context()
        rogue = RogueWorker(ctx, s.backend)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(s.frontend)

        def registered() -> bool:
            rogue.pump(time.monotonic() + 0.05)
            st = s.status(0.5)
            return st is not None and "rogue" in st["workers"]

        try:
            wait_for("the broker to register the rogue worker", registered, 10.0)
            yield s, rogue, client
        finally:
            client.close(0)
            rogue.sock.close(0)
            ctx.term()


def test_a_reply_that_never_comes_frees_pending_and_credit(tmp_path: Path) -> None:
    """A live worker that swallows a request: the caller hears DEADLINE_EXCEEDED at the deadline, and
    after the liveness grace the broker drops the record and frees the credit (it used to keep
    ``pending: 1, inflight: 1`` for ever)."""
    env = {**FAST_HEARTBEAT, "IBEX_HEARTBEAT_LIVENESS": "3"}
    with rogue_stack(tmp_path, env) as (s, rogue, client):
        client.send_multipart(raw_request_frames(_pack(_request("swallowed", timeout_s=0.4))))
        assert len(rogue.pump(time.monotonic() + 0.3)) == 1
        assert client.poll(3000), "no DEADLINE_EXCEEDED from the broker"
        reply = decode_reply(client.recv_multipart()[3])
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DEADLINE_EXCEEDED
        st: dict[str, Any] | None = None

        def freed() -> bool:
            nonlocal st
            rogue.pump(time.monotonic() + 0.1)
            st = s.status(0.5)
            return st is not None and st["pending"] == 0 and st["workers"].get("rogue", {}).get("inflight") == 0

        wait_for("the broker to free the swallowed request's record and credit", freed, 5.0)
        assert st is not None and "rogue" in st["workers"]  # alive, with its credit back
        assert st["stats"]["reaped_no_reply"] == 1


def test_ready_from_a_known_worker_redispatches_what_it_held(tmp_path: Path) -> None:
    """A worker that reconnects announces READY again; what it held went out on the old connection,
    so the broker re-dispatches it (here to the same worker, which sees attempt 2) at once."""
    with rogue_stack(tmp_path, FAST_HEARTBEAT) as (s, rogue, client):
        client.send_multipart(raw_request_frames(_pack(_request("held", timeout_s=5.0))))
        first = rogue.pump(time.monotonic() + 0.5)
        assert [P.Stamp.unpack(f[4]).attempt for f in first] == [1]
        rogue.sock.send_multipart([P.TAG, P.READY, rogue.info])
        again = rogue.pump(time.monotonic() + 0.5)
        assert [P.Stamp.unpack(f[4]).attempt for f in again] == [2]
        st = s.status(1.0)
        assert st is not None and st["stats"]["redispatched"] == 1 and st["stats"]["worker_reconnects"] == 1
