"""Compaction summaries written through the service (protocol SUMMARY; README "Compaction
summaries"): the client sends one fire-and-forget, the broker admits it like a usage report, the
worker validates it, keeps it only when it covers more than the stored one (atomically), with a
TTL, and with ``as_memory`` writes it to the agent's memories; the next assembly that names the
conversation's ``summary_key`` is given it.

The real stack (Redis, memory service, broker, one worker), plain ZeroMQ; tenant scoping by the
broker's key check is covered through CURVE in tests/stack/test_summaries_e2e.py's rig.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.client.sync import SyncClient
from ibex_context.ops.local import LocalStack
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.connect import sync_client
from ibex_context.shared.stores.keys import summary_key
from ibex_context.shared.stores.summaries import decode_summary
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.summary_write import MAX_SUMMARY_BYTES
from ibex_context.worker.summaries import memory_id
from tests.helpers import eventually, start_stack

pytestmark = pytest.mark.timeout(180)

ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "100", "IBEX_CLIENT_TIMEOUT_MS": "3000", "IBEX_RETRIEVAL_TIMEOUT_MS": "3000",
       "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
       "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_SUMMARY_TTL_S": "3600"}
CHAT = [{"role": "system", "content": "You help."},
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": "third question"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("summary-op"), workers=1, env=ENV)
    try:
        s.wait_workers(1)
        yield s
    finally:
        s.stop()


def _stored(stack: LocalStack, org: str, agent: str, key: str) -> tuple[Any, int]:
    r = sync_client(str(stack.redis_url))
    try:
        raw = r.get(summary_key(org, agent, key))
        return (None if raw is None else decode_summary(raw)), int(r.ttl(summary_key(org, agent, key)))
    finally:
        r.close()


def _worker_stat(stack: LocalStack, name: str) -> int:
    snap = stack.status() or {}
    return sum(int(w["stats"].get(name, 0)) for w in snap.get("workers", {}).values())


def _wait(what: str, check: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


async def test_a_summary_is_stored_only_when_it_covers_more(stack: LocalStack) -> None:
    key1 = f"conv:op-1.{secrets.token_hex(4)}"  # each loop's run its own conversation
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        send = {"org_id": "acme", "agent_id": "support-bot", "summary_key": key1}
        assert c.report_summary(**send, text="the first four", covers=4)
        await eventually("stored", lambda: _stored(stack, "acme", "support-bot", key1)[0] is not None, 10)
        got, ttl = _stored(stack, "acme", "support-bot", key1)
        assert (got.text, got.covers) == ("the first four", 4)
        assert 3000 < ttl <= 3600  # IBEX_SUMMARY_TTL_S
        stale = _worker_stat(stack, "summary_stale")
        assert c.report_summary(**send, text="an older one", covers=2)
        assert c.report_summary(**send, text="the same span again", covers=4)
        await eventually("stale twice", lambda: _worker_stat(stack, "summary_stale") >= stale + 2, 10)
        assert _stored(stack, "acme", "support-bot", key1)[0].text == "the first four"
        assert c.report_summary(**send, text="the first six", covers=6, ttl_s=120)
        await eventually("newer", lambda: _stored(stack, "acme", "support-bot", key1)[0].covers == 6, 10)
        assert 0 < _stored(stack, "acme", "support-bot", key1)[1] <= 120  # a shorter TTL asked for
        assert c.stats["summary_sent"] == 4  # this client's own


async def test_an_assembly_naming_the_key_gets_the_stored_summary(stack: LocalStack) -> None:
    key2 = f"conv-op-2.{secrets.token_hex(4)}"
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        assert c.report_summary(org_id="acme", agent_id="support-bot", summary_key=key2,
                                text="The user asked twice, FACT-7 noted.", covers=4)
        await eventually("stored", lambda: _stored(stack, "acme", "support-bot", key2)[0] is not None, 10)
        resp = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", format="openai",
                                query="third question", messages=CHAT, summary_key=key2, timeout=5)
        assert resp.summary is not None and resp.summary.source == "stored" and resp.summary.placed
        assert resp.summary.covers == 4 and resp.history_dropped_upto == 4
        assert any("FACT-7" in str(m.get("content")) for m in resp.messages or [])


async def test_as_memory_writes_a_dated_event_memory(stack: LocalStack) -> None:
    key3 = f"conv-op-3.{secrets.token_hex(4)}"
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        written = _worker_stat(stack, "summary_memory_written")
        assert c.report_summary(org_id="acme", agent_id="memo-bot", summary_key=key3, as_memory=True,
                                text="The customer's locker code is FACT-4242.", covers=2, made_at=1_800_000_000.0)
        await eventually("memory written", lambda: _worker_stat(stack, "summary_memory_written") > written, 15)
    token = mint_org_token(stack.secret, "acme")
    async with httpx.AsyncClient() as http:
        hits = (await http.post(f"{stack.memory_url}/v1/memories/search", headers={"authorization": f"Bearer {token}"},
                                json={"query": "locker code FACT-4242", "agent_id": "memo-bot", "limit": 5,
                                      "min_similarity": 0.0}, timeout=10)).json()["memories"]
    mine = [h for h in hits if h["memory_id"] == memory_id(key3)]
    assert mine and mine[0]["category"] == "event"
    assert mine[0]["content"] == "Conversation summary (2027-01-15): The customer's locker code is FACT-4242."


async def test_bad_summaries_are_refused_with_the_field_named(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        base = {"org_id": "acme", "agent_id": "support-bot", "text": "x", "covers": 2}
        assert not c.report_summary(**base, summary_key="has space")  # the client checks first
        assert not c.report_summary(**{**base, "covers": 0}, summary_key="k")
        assert not c.report_summary(**{**base, "text": "y" * 32_001}, summary_key="k")
        assert c.stats["summary_not_sent"] == 3
        # a raw client past the client's checks: the broker checks the whole summary and answers
        raw = {"request_id": "usage-summary-raw", "org_id": "acme", "agent_id": "support-bot",
               "deadline_ns": time.time_ns() + 10**10, "summary_key": "k", "text": "x", "covers": -1}
        before = c.stats["usage_refused"]
        assert c.conns[0].sock.send(P.usage_frames(msgpack.packb(raw), P.SUMMARY)) is None
        await eventually("broker refusal", lambda: c.stats["usage_refused"] > before, 10)
        assert _stored(stack, "acme", "support-bot", "k")[0] is None
        big = msgpack.packb({**raw, "text": "z" * MAX_SUMMARY_BYTES})
        before = c.stats["usage_refused"]
        assert c.conns[0].sock.send(P.usage_frames(big, P.SUMMARY)) is None
        await eventually("broker refusal", lambda: c.stats["usage_refused"] + c.stats["late_replies_dropped"]
                         > before, 10)
    assert (stack.status() or {})["stats"].get("summary_rejected_invalid", 0) >= 2


def test_the_sync_client_sends_one_too(stack: LocalStack) -> None:
    key4 = f"conv-op-4.{secrets.token_hex(4)}"
    c = SyncClient(stack.frontend)
    try:
        asyncio.run_coroutine_threadsafe(c._client.wait_connected(), c._loop).result(10)
        assert c.report_summary(org_id="globex", agent_id="support-bot", summary_key=key4,
                                text="synced", covers=2)
        assert not c.report_summary(org_id="globex", agent_id="bad agent", summary_key=key4,
                                    text="synced", covers=2)
        _wait("stored", lambda: _stored(stack, "globex", "support-bot", key4)[0] is not None)
        raw = sync_client(str(stack.redis_url)).get(summary_key("globex", "support-bot", key4))
        assert raw is not None and orjson.loads(raw)["covers"] == 2
    finally:
        c.close()


def test_broker_counts_summaries_apart_from_usage(stack: LocalStack, tmp_path: Path) -> None:
    """Counted from this test's own summaries (the module's other tests may run elsewhere or later)."""
    def stats() -> dict[str, int]:
        return (stack.status() or {})["stats"]  # type: ignore[no-any-return]

    before = stats()
    c = SyncClient(stack.frontend)
    try:
        asyncio.run_coroutine_threadsafe(c._client.wait_connected(), c._loop).result(10)
        for i in range(5):
            assert c.report_summary(org_id="globex", agent_id="support-bot", text="counted", covers=2,
                                    summary_key=f"conv-op-5.{secrets.token_hex(4)}.{i}")
    finally:
        c.close()
    want = before.get("summary_forwarded", 0) + 5
    _wait("five summaries forwarded", lambda: stats().get("summary_forwarded", 0) >= want)
    assert stats().get("usage_forwarded", 0) == before.get("usage_forwarded", 0)
