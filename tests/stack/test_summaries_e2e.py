"""Compaction summaries end to end (README "Compaction summaries"): a real LiteLLM proxy with the
hook's ``summaries`` on, the local upstream (its summary answers deterministic: the FACT-<n>
tokens it was given), the real stack with CURVE keys per org; a long tool-using session sent turn
by turn with the openai SDK on an 8K model.

Checked on every upstream request: every FACT of the conversation so far is either in the
summary block or in the kept messages, never both (no gap, no overlap); tool groups whole; the
prompt within the window less the reserve. Then the summary's facts are memories of the agent,
found from a new conversation. And a summary model that fails or hangs changes nothing on the
call path.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy
from ibex_context.client.client import AsyncClient
from ibex_context.client.integrations.litellm.summary import conversation_key
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from ibex_context.shared.config.settings import ClientSettings
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.keys import memory_key, summary_key
from ibex_context.shared.stores.summaries import decode_summary
from ibex_context.worker.summaries import memory_id
from tests.helpers import eventually
from tests.stack.test_litellm_proxy import _keys, curve_hook, curve_stack

pytestmark = pytest.mark.timeout(400)

TURNS = 100  # a summary is due about every 23 turns from the 45th: three of them
MODELS = {"small": "gpt-4", "summarizer": "gpt-4o-mini"}
KEYS = {"sk-acme": {"metadata": {"ibex_org": "acme", "ibex_agent": "long-bot"}},
        "sk-acme-flaky": {"metadata": {"ibex_org": "acme", "ibex_agent": "flaky-bot"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a record up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
FACT = re.compile(r"FACT-\d+")
BLOCK = re.compile(r'<summary nonce="[0-9a-f]+">\n(.*?)\n</summary nonce=', re.DOTALL)
FILLER = ("The customer described the situation at some length, with dates, amounts and the names of people. "
          "They asked for the whole history of the account, every letter sent and every call made, twice.")


@dataclass
class Rig:
    stack: LocalStack
    upstream: Upstream
    proxy: LiteLLMProxy
    redis: redis.Redis
    keys: Path  # the CURVE keypairs (tests.stack.test_litellm_proxy._keys)
    opened: list[openai.OpenAI] = field(default_factory=list)  # closed with the rig

    def sdk(self, key: str) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.proxy.url}/v1", api_key=key, max_retries=0, timeout=60)
        self.opened.append(client)
        return client

    def stored(self, agent: str, key: str) -> Any:
        raw = self.redis.get(summary_key("acme", agent, key))
        return None if raw is None else decode_summary(raw)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("summaries")
    _keys(d)
    stack = curve_stack(d, tmp_path_factory.mktemp("stack"))
    try:
        hook = curve_hook(d, stack, summaries={"model": "summarizer", "max_chars": 4000, "high_water": 0.8,
                                               "low_water": 0.5, "as_memory": True, "timeout_s": 3})
        with hooked_proxy(d, hook, MODELS, KEYS) as (upstream, proxy):
            made = Rig(stack, upstream, proxy, redis.Redis.from_url(str(stack.redis_url)), d)
            r = made.redis
            try:
                yield made
            finally:
                for client in made.opened:
                    client.close()
                r.close()
    finally:
        stack.stop()


def _user(n: int, tag: str) -> dict[str, Any]:
    return {"role": "user", "content": f"[{tag}] Turn {n}: please note FACT-{n}. {FILLER} {FILLER}"}


def _tool_exchange(n: int) -> list[dict[str, Any]]:
    call = {"id": f"call_{n}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "r{n}"}}'}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": f"record r{n}: status open, owner desk {n % 7}"},
            {"role": "assistant", "content": f"Looked record r{n} up."}]


def _check_sent(body: dict[str, Any], upto: int) -> tuple[bool, set[str]]:
    """(a summary was sent, its facts) after checking the no-gap/no-overlap rule and tool groups."""
    messages = body["messages"]
    summary: set[str] = set()
    kept: set[str] = set()
    blocks = 0
    for m in messages:
        text = m.get("content") if isinstance(m.get("content"), str) else ""
        found = BLOCK.search(text or "")
        if found is not None:
            blocks += 1
            summary |= set(FACT.findall(found.group(1)))
        elif m["role"] == "user":
            kept |= set(FACT.findall(text or ""))
    assert blocks <= 1
    every = {f"FACT-{n}" for n in range(upto + 1)}
    assert summary | kept == every, f"gap: {sorted(every - summary - kept, key=len)[:5]}"
    assert not summary & kept, f"overlap: {sorted(summary & kept)[:5]}"
    for i, m in enumerate(messages):  # tool groups whole
        if m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            assert [x.get("tool_call_id") for x in messages[i + 1:i + 1 + len(ids)]] == ids
        if m["role"] == "tool":
            assert any(p.get("tool_calls") and m["tool_call_id"] in [c["id"] for c in p["tool_calls"]]
                       for p in messages[:i])
    return blocks == 1, summary


def test_a_long_session_is_compacted_without_gaps_and_remembered(rig: Rig) -> None:
    tag = secrets.token_hex(4)
    sdk = rig.sdk("sk-acme")
    spec = Catalog.load().model("gpt-4")
    limit = spec.context_window - response_reserve(spec)
    conv: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}, _user(0, tag)]
    key = conversation_key({}, {}, "acme", "long-bot", conv)
    summaries, first_summary_turn, waited = 0, None, 0.0
    started = time.monotonic()
    for n in range(1, TURNS + 1):
        conv.append(_user(n, tag))
        rig.upstream.clear()
        raw = sdk.chat.completions.with_raw_response.create(model="small", messages=conv, tools=TOOLS)  # type: ignore[arg-type]
        assert raw.headers["x-ibex-context"] == "assembled", raw.headers.get("x-ibex-context-reason")
        calls = [r for r in rig.upstream.received() if not r.get("summary")]
        assert len(calls) == 1
        assert calls[0]["prompt_tokens"] <= limit
        sent, _ = _check_sent(calls[0]["body"], n)
        if sent:
            first_summary_turn = first_summary_turn or n
        elif first_summary_turn is not None:
            raise AssertionError(f"turn {n}: no summary after the first at turn {first_summary_turn}")
        due = raw.headers.get("x-ibex-context-summary-due")
        if due is not None:  # an agent's turn takes seconds: the summary is stored before the next
            t0 = time.monotonic()
            deadline = t0 + 20
            while (got := rig.stored("long-bot", key)) is None or got.covers < int(due):
                assert time.monotonic() < deadline, f"turn {n}: summary covering {due} not stored"
                time.sleep(0.02)
            waited += time.monotonic() - t0
            summaries += 1
        conv.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        if n % 4 == 0:
            conv.extend(_tool_exchange(n))
    elapsed = time.monotonic() - started
    print(f"\n{TURNS} turns in {elapsed:.1f} s ({waited:.1f} s waiting for {summaries} summaries); "
          f"first summary sent at turn {first_summary_turn}")
    assert summaries >= 3 and first_summary_turn is not None
    # the summary became the agent's memory (written after it was stored: wait for it, or say why not)
    mkey = memory_key("acme", "long-bot", memory_id(key))
    deadline = time.monotonic() + 20
    while "FACT-3 " not in (rig.redis.hget(mkey, "content") or b"").decode():
        if time.monotonic() > deadline:  # the workers' summary outcomes say which step failed
            snap = rig.stack.status() or {}
            outcomes = {k: v for w in snap.get("workers", {}).values() for k, v in w["stats"].items()
                        if k.startswith("summary_")}
            raise AssertionError(f"the summary memory was not written: {outcomes}")
        time.sleep(0.05)
    # a new conversation of the same agent finds an early fact among its memories. The question has
    # no random tag: a tag's made-up words moved its relevance to the summary by up to 0.1, around
    # the search's floor (0.15); without one it is the same every run (0.32 on the shipped minilm)
    rig.upstream.clear()
    fresh = [{"role": "user", "content": "What did I ask you to note as FACT-3?"}]
    raw = sdk.chat.completions.with_raw_response.create(model="small", messages=fresh)  # type: ignore[arg-type]
    assert raw.headers["x-ibex-context"] == "assembled"
    body = next(r for r in rig.upstream.received() if not r.get("summary"))["body"]
    memories = [m["content"] for m in body["messages"] if "<memories nonce=" in str(m.get("content"))]
    assert memories and "FACT-3 " in memories[0] and "Conversation summary (" in memories[0], (
        {k: v for k, v in raw.headers.items() if k.startswith("x-ibex")},
        [str(m.get("content"))[:300] for m in body["messages"]],
        _search_now(rig, fresh[0]["content"]))


def _search_now(rig: Rig, question: str) -> object:
    """What the memory service's search answers for ``question`` now (a failure's diagnosis)."""
    token = mint_org_token(rig.stack.secret, "acme")
    r = httpx.post(rig.stack.memory_url + "/v1/memories/search", headers={"authorization": f"Bearer {token}"},
                   json={"query": question, "agent_id": "long-bot", "limit": 5}, timeout=10)
    doc = r.json()
    return [{k: m.get(k) for k in ("memory_id", "relevance", "text_score", "vector_score")}
            for m in doc.get("memories", [])], doc.get("below_cutoff")


def test_a_failing_or_hanging_summary_model_changes_nothing_on_the_call_path(rig: Rig) -> None:
    sdk = rig.sdk("sk-acme-flaky")
    big = FILLER * 12  # ~460 tokens a turn: 39 turns are twice an 8K window, however it is calibrated
    for mode in ("fail", "hang"):
        rig.upstream.summary_mode(mode)
        try:
            conv: list[dict[str, Any]] = [{"role": "user", "content": f"[{mode}-{secrets.token_hex(4)}] FACT-0 {big}"}]
            key = conversation_key({}, {}, "acme", "flaky-bot", conv)
            dues, trimmed = 0, 0
            for n in range(1, 40):
                conv.append({"role": "user", "content": f"Turn {n}: FACT-{n}. {big}"})
                rig.upstream.clear()
                t0 = time.monotonic()
                raw = sdk.chat.completions.with_raw_response.create(model="small", messages=conv)  # type: ignore[arg-type]
                assert time.monotonic() - t0 < 5.0  # never waits on the summary model
                assert raw.headers["x-ibex-context"] == "assembled"
                calls = [r for r in rig.upstream.received() if not r.get("summary")]
                assert len(calls) == 1 and "<summary nonce=" not in str(calls[0]["body"]["messages"])
                dues += "x-ibex-context-summary-due" in raw.headers
                trimmed += "FACT-0 " not in str(calls[0]["body"]["messages"])
                conv.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            # summaries were due and failed; calls trimmed as without them
            assert dues >= 5 and trimmed >= 5, (dues, trimmed, rig.stored("flaky-bot", key), calls[0]["prompt_tokens"])
            assert rig.stored("flaky-bot", key) is None
        finally:
            rig.upstream.summary_mode("digest")


async def test_the_broker_scopes_a_summary_to_the_callers_org(rig: Rig) -> None:
    """acme's key cannot store a summary in globex's namespace: FORBIDDEN, nothing stored."""
    settings = ClientSettings(client_key_file=str(rig.keys / "acme-proxy.key"),
                              broker_public_key=str(rig.keys / "broker.pub"))
    async with AsyncClient(rig.stack.frontend, settings=settings) as c:
        await c.wait_connected()
        assert c.report_summary(org_id="globex", agent_id="support-bot", summary_key="stolen", text="x", covers=2)
        await eventually("refused", lambda: c.stats["usage_refused"] >= 1, 10)
        assert c.report_summary(org_id="acme", agent_id="support-bot", summary_key="own", text="mine", covers=2)
        await eventually("stored", lambda: rig.redis.get(summary_key("acme", "support-bot", "own")) is not None, 10)
    assert rig.redis.get(summary_key("globex", "support-bot", "stolen")) is None
