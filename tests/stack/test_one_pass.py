"""One pass for every request form: the conversation is parsed and counted before retrieval, and
a chat request and a simple one run the same stages in the same order."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import redis

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline import format as fmt
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.errors import InvalidRequest
from ibex_context.shared.wire.models import AssembleRequest
from tests.helpers import start_stack

CATALOG = Catalog.load()
HITS = [MemoryHit(f"m{i}", f"memory {i}: the October invoice went to billing contact {i}", "fact", 0.9 - i / 100,
                  0.8, i + 1, "hot") for i in range(8)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_DEADLINE_MS": "3000",
           # no calibration re-read during a test: Redis's command counts move only by what a request does
           "IBEX_CALIBRATION_REFRESH_MS": "3600000"}
    s = start_stack(tmp_path_factory.mktemp("one_pass"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


def _calls(r: redis.Redis) -> dict[str, int]:
    """Redis commands served so far, by name (INFO itself left out: reading them is one)."""
    stats: dict[str, Any] = r.info("commandstats")
    return {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_ping")}


async def _quiet_calls(r: redis.Redis, quiet_s: float = 1.0, timeout_s: float = 30.0) -> dict[str, int]:
    """The command counts once nothing has moved them for ``quiet_s``: what an earlier request
    left to do in the background (its calibration record, written up to 0.25 s later, or later on
    a loaded machine) is done before a comparison starts."""
    end = time.monotonic() + timeout_s
    last = _calls(r)
    while time.monotonic() < end:
        await asyncio.sleep(quiet_s)
        now = _calls(r)
        if now == last:
            return now
        last = now
    raise AssertionError(f"Redis never went quiet for {quiet_s} s within {timeout_s} s: {last}")


async def test_a_bad_conversation_is_refused_before_any_retrieval(stack: LocalStack) -> None:
    r = redis.Redis.from_url(str(stack.redis_url))
    orphan = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "orphan"}]
    try:
        async with AsyncClient(stack.frontend) as c:
            # the first calls warm the worker's connections; on a loaded machine one may still see a
            # branch time out, so warm until one call retrieves on both branches
            for _ in range(10):
                ok = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query="invoice",
                                      format="openai", messages=[{"role": "user", "content": "hi"}], timeout=5.0)
                if ok.branches["directive"].status == "success" and ok.branches["hot"].status == "success":
                    break
            assert ok.branches["directive"].status == "success" and ok.branches["hot"].status == "success"
            before = await _quiet_calls(r)
            with pytest.raises(InvalidRequest) as err:
                await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query="invoice",
                                 format="openai", messages=orphan, timeout=5.0)
            assert err.value.field is not None and err.value.field.startswith("messages")
            assert _calls(r) == before  # no directive GET, no memory-service search: nothing was retrieved
            await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query="invoice",
                             format="openai", messages=[{"role": "user", "content": "hi"}], timeout=5.0)
            assert _calls(r) != before  # the same comparison sees a retrieval
    finally:
        r.close()


STAGE_MODULES = tuple(f"ibex_context.pipeline.{m}" for m in ("assemble", "rendering.turns", "conversation.fit",
                                                            "rendering.emit"))


def _stage_calls(req: AssembleRequest) -> list[str]:
    """The pipeline's stage functions ``assemble`` calls for ``req``, in order (the renderers,
    counters and formatter below them are each target's own, so they are left out)."""
    seen: list[str] = []

    def hook(frame: FrameType, event: str, _arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module in STAGE_MODULES and not frame.f_code.co_name.startswith("<"):
            seen.append(f"{module.rpartition('.')[2]}.{frame.f_code.co_qualname}")

    retrieval = offline_result(directive="Answer briefly.", hot=HITS, cold=[])
    engine = Engine(CATALOG, Policy())
    sys.setprofile(hook)
    try:
        assemble(req, retrieval, engine)
    finally:
        sys.setprofile(None)
    return seen


def test_a_chat_request_and_a_simple_one_run_the_same_stages_in_the_same_order() -> None:
    conversation = [{"role": "user", "content": "Where is my invoice?"},
                    {"role": "assistant", "content": "Which month?"},
                    {"role": "user", "content": "October."}]
    common: dict[str, Any] = {"request_id": "r", "org_id": "acme", "agent_id": "bot", "model": "gpt-4o",
                              "query": "invoice", "deadline_ns": 1}
    simple = AssembleRequest.model_validate({**common, "recent_messages": conversation})
    chat = AssembleRequest.model_validate({**common, "format": "openai", "messages": conversation})
    anthropic = AssembleRequest.model_validate({**common, "model": "claude-sonnet-4", "format": "anthropic",
                                                "messages": conversation})
    calls = _stage_calls(simple)
    assert calls[:1] == ["assemble.assemble"] and "fit.fit_stage" in calls and "emit.emit_stage" in calls
    assert _stage_calls(chat) == calls
    assert _stage_calls(anthropic) == calls


def test_the_nonce_key_comes_in_through_the_policy() -> None:
    """The pure pipeline reads no environment: the derived nonce is keyed by ``Policy.nonce_key``."""
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model="gpt-4o", query="q", deadline_ns=1)
    retrieval = offline_result(directive=None, hot=HITS, cold=[])
    a = assemble(req, retrieval, Engine(CATALOG, Policy(nonce_key=b"a" * 32)))
    b = assemble(req, retrieval, Engine(CATALOG, Policy(nonce_key=b"b" * 32)))
    lines = [fmt.memory_line(h) for h in HITS if h.memory_id in {p.memory_id for p in a.packed}]
    assert a.packed and a.nonce == fmt.derive_nonce(b"a" * 32, lines) != b.nonce
