"""A caller's ``request_id`` is a label, never the key its reply is matched by.

The client library correlates each attempt by an id of its own (the request's correlation frame),
so two callers of one client (a LiteLLM proxy's users of one org, say) that send the same
``request_id`` at the same time each get the reply to their own request, never the other's, and
neither is refused as a duplicate or left to time out and degrade. The broker keys its in-flight
table by that correlation id; a request sent without one (a raw client) is still matched by its
request_id. Everything here runs on the real stack: broker, workers, Redis, memory service, ZeroMQ.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from ibex_context.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.conversation.layout import materialize
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.models import AssembleResponse, ChatLayout
from ibex_context.shared.wire.protocol import Envelope, pack_header
from tests.helpers import start_stack

# The client library runs on its caller's loop: every async test here runs on asyncio and uvloop.
pytestmark = pytest.mark.both_loops

STACK_ENV = {
    "IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_WORKER_CONCURRENCY": "16",
    "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "1500", "IBEX_COLD_TIMEOUT_MS": "1500",
    "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30",
}
SHARED_ID = "chatcmpl-same-call-id"  # what two callers put in x-litellm-call-id
USERS = ("alice", "bob")
PER_USER = 4  # calls per user in flight at once, all with the same request_id
ROUNDS = 15
TIMEOUT_S = 3.0
STAGGER_S = 0.002


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("correlation-stack"), seed=False, workers=2, env=STACK_ENV,
                    enable_faults=True)
    try:
        asyncio.run(_warm(s))
        yield s
    finally:
        s.stop()


async def _warm(stack: LocalStack) -> None:
    """Until every worker has served an assembly in full: a cold first retrieval may time out, and
    that degradation is not what these tests are about."""
    async with AsyncClient(stack.frontend) as client:
        await client.wait_connected()
        for n in range(50):
            got = await asyncio.gather(*(client.assemble(timeout=TIMEOUT_S, **{**_chat("warm", n, i),
                                                                              "request_id": f"warm-{n}-{i}"})
                                         for i in range(8)))
            if not any(r.degraded for r in got):
                return
        raise AssertionError(f"the stack never served a round in full: {got[0].degraded_reasons}")


def _marker(user: str, rnd: int, i: int) -> str:
    return f"{user} private question r{rnd} n{i}: my account number is {user}-{rnd}-{i}"


def _chat(user: str, rnd: int, i: int) -> dict[str, Any]:
    """One user's chat-native call; everything but the conversation is the same for both users."""
    text = _marker(user, rnd, i)
    return {"request_id": SHARED_ID, "org_id": "acme", "agent_id": "support-bot", "model": "gpt-4o",
            "format": "openai", "query": text, "messages": [{"role": "user", "content": text}]}


def served(reasons: list[str]) -> bool:
    """Whether a response's degradation reasons say the service answered: the client's own fallback
    says ``context service <CODE>: ...``. A retrieval branch that timed out in the worker (these two
    cores are shared) still leaves the caller's own reply, served; a collision never does that."""
    return not any(r.startswith("context service") for r in reasons)


def _own_reply(resp: object, user: str, rnd: int, i: int) -> str | None:
    """Why ``resp`` is not this caller's own reply, served by a worker (None when it is)."""
    if not isinstance(resp, AssembleResponse):
        return f"{type(resp).__name__}: {resp}"
    if not resp.worker_id or not served(resp.degraded_reasons):
        return f"degraded: {resp.degraded_reasons}"
    if resp.request_id != SHARED_ID:
        return f"request_id {resp.request_id!r}, not the caller's"
    contents = [m.get("content") for m in resp.messages or []]
    if contents[-1:] != [_marker(user, rnd, i)]:
        return f"another caller's conversation: {contents!r:.200}"
    return None


async def _round(client: AsyncClient, rnd: int, *, degrade: bool) -> list[str]:
    """One round: every call at once (even rounds), or each started a few ms after the last (odd
    rounds), so that a reply often arrives while a call with the same id is waiting for its own."""
    calls = [(user, i) for i in range(PER_USER) for user in USERS]  # interleaved: alice 0, bob 0, alice 1, ...
    fn = client.assemble_or_degrade if degrade else client.assemble

    async def call(n: int, user: str, i: int) -> AssembleResponse:
        await asyncio.sleep(0 if rnd % 2 == 0 else n * STAGGER_S)
        return await fn(timeout=TIMEOUT_S, **_chat(user, rnd, i))

    got = await asyncio.gather(*(call(n, user, i) for n, (user, i) in enumerate(calls)), return_exceptions=True)
    return [f"round {rnd} {user} #{i}: {why}" for (user, i), resp in zip(calls, got, strict=True)
            if (why := _own_reply(resp, user, rnd, i)) is not None]


@pytest.mark.parametrize("degrade", [True, False], ids=["assemble_or_degrade", "assemble"])
async def test_callers_sharing_a_request_id_each_get_their_own_reply(stack: LocalStack, degrade: bool) -> None:
    """Two users of one org, one client, the same request_id, many calls in flight at once: every
    caller gets the reply built from its own conversation, served by a worker (not refused, not the
    fallback), under its own request_id."""
    async with AsyncClient(stack.frontend) as client:
        await client.wait_connected()
        await client.prepare_fallback()
        wrong: list[str] = []
        for rnd in range(ROUNDS):
            wrong += await _round(client, rnd, degrade=degrade)
        late = client.stats["late_replies_dropped"]
    kinds = collections.Counter(w.split(": ", 1)[1].split(":")[0] for w in wrong)
    assert not wrong, f"{len(wrong)} of {ROUNDS * len(USERS) * PER_USER} calls wrong {dict(kinds)}:\n" + "\n".join(
        sorted(wrong, key=lambda w: "another" not in w)[:12])
    assert late == 0


async def test_the_same_request_id_from_two_clients_and_in_sequence(stack: LocalStack) -> None:
    """Two clients (two proxies) sending the same request_id at once, then one client reusing it
    call after call: each call is answered with its own conversation."""
    async with AsyncClient(stack.frontend) as a, AsyncClient(stack.frontend) as b:
        await a.wait_connected()
        await b.wait_connected()
        got = await asyncio.gather(*(c.assemble(timeout=TIMEOUT_S, **_chat(user, 0, i))
                                     for i in range(3) for c, user in ((a, "alice"), (b, "bob"))))
        assert [_own_reply(r, user, 0, i) for r, (i, user) in
                zip(got, [(i, u) for i in range(3) for u in ("alice", "bob")], strict=True)] == [None] * 6
        for i in range(5):
            assert _own_reply(await a.assemble(timeout=TIMEOUT_S, **_chat("alice", 1, i)), "alice", 1, i) is None


# ------------------------------------------------------------------------------ the broker, raw frames


def _raw_messages(user: str, i: int) -> list[dict[str, Any]]:
    """A raw caller's conversation: bob's is two messages longer than alice's, so a reply's layout
    applied to the other caller's conversation can never give back this one's."""
    earlier = [{"role": "user", "content": "earlier turn"}, {"role": "assistant", "content": "noted"}]
    return [*(earlier if user == "bob" else []), {"role": "user", "content": _marker(user, 9, i)}]


def _rebuilt_last(body: dict[str, Any], user: str, i: int) -> str:
    """The last message of the conversation a raw reply's layout gives this caller's own messages
    (a reply carries the layout, never the caller's messages: docs/assembly.md "Size limits")."""
    content: str = materialize(ChatLayout.model_validate(body["layout"]), _raw_messages(user, i))[0][-1]["content"]
    return content


def _frames(user: str, i: int, correlation: bytes | None) -> list[bytes]:
    doc = {"v": 1, **_chat(user, 9, i), "deadline_ns": time.time_ns() + 5 * 10**9,
           "messages": _raw_messages(user, i)}
    header = pack_header(Envelope(doc["request_id"], doc["org_id"], doc["agent_id"], doc["deadline_ns"]))
    frames = P.request_frames(header, msgpack.packb(doc))
    return frames if correlation is None else [P.TAG, P.CORRELATED, correlation, *frames[2:]]


async def _exchange(stack: LocalStack, messages: list[list[bytes]], expect: int) -> list[list[bytes]]:
    """Send every message on one DEALER at once, then read ``expect`` replies."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.frontend)
    try:
        for msg in messages:
            await sock.send_multipart(msg)
        return [await asyncio.wait_for(sock.recv_multipart(), 10) for _ in range(expect)]
    finally:
        sock.close()
        ctx.term()


async def test_the_broker_keys_requests_by_their_correlation_id(stack: LocalStack) -> None:
    """One connection, the same request_id twice at once, two correlation ids: both are served, each
    answered under its own correlation id with its own conversation and the caller's request_id."""
    got = await _exchange(stack, [_frames("alice", 0, b"c-1"), _frames("bob", 0, b"c-2")], 2)
    by_corr = {f[2]: msgpack.unpackb(f[3]) for f in got}
    assert sorted(by_corr) == [b"c-1", b"c-2"] and all(f[1] == P.REPLY for f in got), got
    for corr, user in ((b"c-1", "alice"), (b"c-2", "bob")):
        body = by_corr[corr]
        assert body["request_id"] == SHARED_ID and _rebuilt_last(body, user, 0) == _marker(user, 9, 0)


async def test_a_request_without_a_correlation_frame_is_matched_by_its_request_id(stack: LocalStack) -> None:
    """A raw client's request without a correlation frame is answered under its request_id; a second
    one with the same id while the first is in flight is refused (its replies could not be told
    apart), and the refusal names the field."""
    # a slow memory service keeps the first in flight when the second arrives (on an idle machine
    # the first was answered before the second came in, and both were served)
    async with httpx.AsyncClient(base_url=stack.memory_url, timeout=5) as http:
        slow = await http.put("/_faults", json={"endpoint": "all", "latency_ms": 300})
        assert slow.status_code == 200
        try:
            got = await _exchange(stack, [_frames("alice", 1, None), _frames("bob", 1, None)], 2)
        finally:
            assert (await http.delete("/_faults")).status_code == 200
    assert [f[2] for f in got] == [SHARED_ID.encode()] * 2
    bodies = [(f[1], msgpack.unpackb(f[3])) for f in got]
    refused = [b for cmd, b in bodies if cmd == P.ERROR]
    served = [b for cmd, b in bodies if cmd == P.REPLY]
    assert len(refused) == 1 and refused[0]["field"] == "request_id" and "already in flight" in refused[0]["message"]
    assert len(served) == 1 and _rebuilt_last(served[0], "alice", 1) == _marker("alice", 9, 1)


def test_correlated_requests_round_trip_and_their_ids_are_bounded() -> None:
    longest = b"c" * P.MAX_CORRELATION_BYTES
    frames = P.correlated_frames(P.request_frames(b"head", b"payload"), longest)
    assert frames is not None and P.parse_client_message(frames) == P.ClientRequest(b"payload", b"head", longest)
    with pytest.raises(P.FrameError, match="request_frames"):  # only a request has a correlated form
        P.correlated_frames(P.status_request_frames(), b"c")
    for bad in (b"", longest + b"c"):
        with pytest.raises(P.FrameError, match="CORRELATED, an id of 1 to 64 bytes"):
            P.parse_client_message([P.TAG, P.CORRELATED, bad, b"head", b"payload"])


@pytest.mark.parametrize("size", ["empty", "too-long"])
async def test_a_malformed_correlation_frame_is_refused(stack: LocalStack, size: str) -> None:
    correlation = b"" if size == "empty" else b"x" * (P.MAX_CORRELATION_BYTES + 1)
    got = await _exchange(stack, [_frames("alice", 2, correlation)], 1)
    assert got[0][1] == P.ERROR and msgpack.unpackb(got[0][3])["code"] == "INVALID_REQUEST", got


# ------------------------------------------------------------------------------ the LiteLLM hook

CALLERS = (("alice", "acme"), ("bob", "acme"), ("carol", "globex"))  # two users of acme, one of globex


def _conversation(user: str, rnd: int, i: int, n: int) -> str:
    """One call's user message; each call padded differently, so each assembly's prompt count is its own."""
    return _marker(user, rnd, i) + " and more" * n


async def _litellm_round(hook: Any, rnd: int, reports: list[tuple[str, AssembleResponse, object]]) -> list[str]:
    """Every caller twice at once, all under one call id; then the provider's usage of each call, the
    last call's first. What went wrong, one line per call."""
    from litellm.proxy._types import UserAPIKeyAuth

    calls = [(user, org, i) for i in range(2) for user, org in CALLERS]
    texts = [_conversation(user, rnd, i, n) for n, (user, _, i) in enumerate(calls)]
    datas = [{"model": "gpt-4o", "litellm_call_id": SHARED_ID, "metadata": {},
              "messages": [{"role": "user", "content": text}]} for text in texts]
    keys = [UserAPIKeyAuth(api_key=f"sk-{user}", metadata={"ibex_org": org, "ibex_agent": "support-bot"})
            for user, org, _ in calls]
    outs = await asyncio.gather(*(hook.async_pre_call_hook(k, None, d, "acompletion")
                                  for k, d in zip(keys, datas, strict=True)), return_exceptions=True)
    wrong = []
    for n, ((user, _, i), out) in enumerate(zip(calls, outs, strict=True)):
        if isinstance(out, BaseException):
            wrong.append(f"round {rnd} {user} #{i}: {type(out).__name__}: {out}")
            continue
        got = await hook.async_post_call_response_headers_hook(out, None, None)
        sent = out["messages"][-1]["content"]
        status, why = (got or {}).get("x-ibex-context"), (got or {}).get("x-ibex-context-reason", "")
        if not (status == "assembled" or (status == "degraded" and served(why.split("; ")))) or sent != texts[n]:
            wrong.append(f"round {rnd} {user} #{i}: {got} sent {sent!r:.80}")
        elif got is not None and got.get("x-ibex-context-request-id") != SHARED_ID:
            wrong.append(f"round {rnd} {user} #{i}: request id header {got}")
    reports.clear()
    for n in reversed(range(len(calls))):
        kwargs = {"litellm_call_id": SHARED_ID, "stream": False, "call_type": "acompletion",
                  "litellm_params": {"metadata": datas[n]["metadata"]}}  # as LiteLLM hands it to callbacks
        usage = SimpleNamespace(usage=SimpleNamespace(prompt_tokens=1000 + n, prompt_tokens_details=None))
        await hook.async_log_success_event(kwargs, usage, None, None)
    for n, (user, org, i) in enumerate(calls):
        counted = (datas[n]["metadata"].get("ibex_context") or {}).get("prompt_tokens")
        mine = [(o, a.prompt_tokens) for o, a, p in reports if p == 1000 + n]
        if mine != [(org, counted)]:
            wrong.append(f"round {rnd} {user} #{i}: its usage was reported as {mine}, its assembly counted "
                         f"{counted} in {org}")
    return wrong


async def test_litellm_calls_sharing_a_call_id_each_get_their_own_assembly_and_usage(stack: LocalStack) -> None:
    """Three callers (two of acme, one of globex) send the same ``x-litellm-call-id`` at once, round
    after round: each call's messages become the assembly of its own conversation, served by the
    service (not refused, not the fallback), and each provider's usage is reported once, for that
    call's own assembly, through its own org's client, though the calls finish in the opposite order."""
    from ibex_context.client.integrations.litellm import IbexContextHook
    from ibex_context.client.integrations.litellm.config import parse_config

    hook = IbexContextHook(parse_config({"orgs": {"acme": {}, "globex": {}}, "endpoints": [stack.frontend],
                                         "timeout_ms": int(TIMEOUT_S * 1000)}))
    reports: list[tuple[str, AssembleResponse, object]] = []
    for org, client in hook.core._clients.items():
        def report(assembly: AssembleResponse, *, prompt_tokens: int, cached_tokens: int | None = None,
                   org: str = org) -> None:
            reports.append((org, assembly, prompt_tokens))
        client.report_usage = report  # type: ignore[method-assign]
    wrong: list[str] = []
    try:
        for rnd in range(ROUNDS // 3):
            wrong += await _litellm_round(hook, rnd, reports)
    finally:
        await hook.core.aclose()
    assert not wrong, f"{len(wrong)} wrong:\n" + "\n".join(wrong[:12])
