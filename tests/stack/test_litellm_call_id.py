"""Callers of a real LiteLLM proxy that send the same ``x-litellm-call-id`` at once each get their own
assembly, and each call's usage is reported once (docs/litellm.md).

LiteLLM takes its call id from that header, and the hook passes it on as the assembly's
``request_id``: a label only. A real ``litellm`` proxy (offline, loopback) with the hook, the local
upstream that records what it received, and the real stack (plaintext loopback broker, two workers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy
from ibex_context.ops.stack import LocalStack
from tests.helpers import eventually, start_stack

pytestmark = pytest.mark.timeout(300)

ENV = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_WORKER_CONCURRENCY": "16", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000",
       "IBEX_HOT_TIMEOUT_MS": "1500", "IBEX_COLD_TIMEOUT_MS": "1500", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
KEYS = {  # two users of acme and one of globex, as the proxy admin set them up
    "sk-alice": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}},
    "sk-bob": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}},
    "sk-carol": {"metadata": {"ibex_org": "globex", "ibex_agent": "support-bot"}},
}
CALL_ID = "chatcmpl-shared-by-everyone"
ROUNDS = 4
PER_KEY = 3


@dataclass
class Rig:
    stack: LocalStack
    upstream: Upstream
    proxy: LiteLLMProxy


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("litellm-call-id")
    stack = start_stack(tmp_path_factory.mktemp("stack"), seed=False, workers=2, env=ENV)
    try:
        hook = {"endpoints": [stack.frontend], "timeout_ms": 3000, "orgs": {"acme": {}, "globex": {}}}
        with hooked_proxy(d, hook, {"gpt-4o": "gpt-4o"}, KEYS) as (upstream, proxy):
            yield Rig(stack, upstream, proxy)
    finally:
        stack.stop()


def _text(key: str, rnd: int, i: int) -> str:
    return f"{key} asks, round {rnd} call {i}: what is the balance of account {key}-{rnd}-{i}?"


async def _call(http: httpx.AsyncClient, rig: Rig, key: str, text: str, tag: str, call_id: str) -> httpx.Response:
    return await http.post(f"{rig.proxy.url}/v1/chat/completions",
                           headers={"authorization": f"Bearer {key}", "x-litellm-call-id": call_id},
                           json={"model": "gpt-4o", "user": tag, "messages": [{"role": "user", "content": text}]})


def _usage_forwarded(stack: LocalStack) -> int:
    st = stack.status(5.0)
    assert st is not None, "the broker did not answer STATUS"
    return int(st["stats"].get("usage_forwarded", 0))


async def _settled_usage(stack: LocalStack, timeout_s: float = 10.0) -> int:
    """The broker's usage_forwarded count once it has stopped moving (three equal reads 0.3 s apart)."""
    seen = [_usage_forwarded(stack)]
    end = time.monotonic() + timeout_s
    while len(seen) < 3 or len(set(seen[-3:])) > 1:
        if time.monotonic() > end:
            raise AssertionError(f"usage reports still arriving after {timeout_s} s: {seen[-5:]}")
        await asyncio.sleep(0.3)
        seen.append(_usage_forwarded(stack))
    return seen[-1]


async def _warm(http: httpx.AsyncClient, rig: Rig) -> None:
    """Until both orgs' calls are assembled in full: a cold first retrieval may time out."""
    for n in range(40):
        got = await asyncio.gather(*(_call(http, rig, key, "hello", f"warm-{n}", f"warm-{n}-{key}") for key in KEYS))
        if all(r.headers.get("x-ibex-context") == "assembled" for r in got):
            return
    raise AssertionError(f"the hook never assembled a round in full: {got[0].headers}")


async def test_calls_sharing_a_litellm_call_id_each_get_their_own_assembly(rig: Rig) -> None:
    """Every call under one ``x-litellm-call-id``, many at once: each is served by the service (not
    refused, not the fallback), the upstream receives each call's own conversation, and every call's
    usage is reported, once."""
    wrong: list[str] = []
    async with httpx.AsyncClient(timeout=60) as http:
        await _warm(http, rig)
        rig.upstream.clear()
        before = await _settled_usage(rig.stack)  # the warm-up's own reports land after its calls
        calls = [(key, rnd, i) for rnd in range(ROUNDS) for i in range(PER_KEY) for key in KEYS]
        for rnd in range(ROUNDS):
            mine = [(key, r, i) for key, r, i in calls if r == rnd]
            got = await asyncio.gather(*(_call(http, rig, key, _text(key, r, i), f"{key}-{r}-{i}", CALL_ID)
                                         for key, r, i in mine))
            for (key, r, i), resp in zip(mine, got, strict=True):
                head = {k: v for k, v in resp.headers.items() if k.startswith("x-ibex-context")}
                # the service answered (a retrieval branch may time out on these shared cores; the
                # fallback, "context service ...", is what a collision leaves)
                answered = head.get("x-ibex-context") == "assembled" or (
                    head.get("x-ibex-context") == "degraded" and "context service" not in head["x-ibex-context-reason"])
                if resp.status_code != 200 or not answered or head.get("x-ibex-context-request-id") != CALL_ID:
                    wrong.append(f"{key} round {r} #{i}: {resp.status_code} {head} {resp.text[:200]}")
    sent: dict[str, Any] = {}
    for rec in rig.upstream.received():
        body = rec["body"]
        sent[body.get("user")] = [m.get("content") for m in body["messages"] if m.get("role") == "user"]
    for key, r, i in calls:
        if sent.get(f"{key}-{r}-{i}") != [_text(key, r, i)]:
            wrong.append(f"{key} round {r} #{i}: the upstream received {sent.get(f'{key}-{r}-{i}')!r:.200}")
    assert not wrong, f"{len(wrong)} problems in {len(calls)} calls:\n" + "\n".join(wrong[:12])
    # the hook reports each call's usage after LiteLLM logs the call's success
    await eventually(f"{len(calls)} usage reports", lambda: _usage_forwarded(rig.stack) - before >= len(calls), 10)
    assert _usage_forwarded(rig.stack) - before == len(calls)
