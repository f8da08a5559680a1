"""Large chat assemblies on the real stack (broker, worker, Redis, memory service over ZeroMQ).

What a new user's first calls send: hundreds of long turns, a 1M-token window, a screenshot as a
data URL. Each is assembled and trimmed to fit instead of refused for its size, the caller's parts
come back as the very objects passed, and the bytes each way are what the service needs (docs/assembly.md
"Size limits"; the conversations are bench/wire_size.py's, which prints the same figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.wire_size import cases, kept, measure
from ibex_context.client import AsyncClient, InvalidRequest
from ibex_context.ops.stack import LocalStack, free_port
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.models import AssembleResponse
from tests.helpers import start_stack

CATALOG = Catalog.load()
CASES = cases()
BIG, TRIAL, SCREENSHOT = (CASES["300 turns, 5 MB, gpt-4.1 (1M)"], CASES["200 turns x 1,500 words, gpt-4 (8K)"],
                          CASES["1000x800 PNG data URL, gpt-4.1"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
    s = start_stack(tmp_path_factory.mktemp("wire"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


def _check_fits(resp: AssembleResponse, fields: dict[str, Any]) -> None:
    """Assembled (not degraded), within the window by the provider's count of what is sent, and
    every caller message in it the caller's own object, in order, the latest turn included."""
    assert not resp.degraded, resp.degraded_reasons
    assert resp.messages is not None and resp.prompt_tokens is not None
    counter = CATALOG.counter(CATALOG.model(fields["model"]).family.name)
    assert resp.prompt_tokens == cc.openai_prompt_tokens(resp.messages, [], counter, model=fields["model"])
    assert resp.prompt_tokens <= resp.budget.context_window - resp.budget.response_reserve
    caller = fields["messages"]
    ids = {id(m): i for i, m in enumerate(caller)}
    order = [ids[id(m)] for m in resp.messages if id(m) in ids]
    assert order == sorted(order) and order[-1] == len(caller) - 1 and len(order) == kept(resp)


async def test_a_5_mb_300_turn_conversation_on_a_1m_window_is_trimmed_to_fit(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(timeout=60.0, **BIG)
    _check_fits(resp, BIG)
    assert resp.history and resp.prompt_tokens > 900_000  # trimmed, and still most of the window
    wire = measure(stack.frontend, BIG)
    assert 5_000_000 < wire.request_after == wire.request_before < Settings().max_request_bytes
    assert wire.reply_before > 4_000_000 and wire.reply_after < 64_000  # a layout, not the conversation again


async def test_the_trial_conversation_on_an_8k_model_is_trimmed_to_fit(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(timeout=60.0, **TRIAL)
    _check_fits(resp, TRIAL)
    assert len(resp.history) > 150 and kept(resp) >= 2 and resp.packed  # the latest turns, and memories
    wire = measure(stack.frontend, TRIAL)
    assert wire.request_after > 1_800_000 and wire.reply_after < wire.reply_before


async def test_a_3_mb_screenshot_is_counted_by_its_size_and_returned_byte_identical(stack: LocalStack) -> None:
    part = SCREENSHOT["messages"][0]["content"][1]
    url = part["image_url"]["url"]
    assert len(url) > 3_000_000
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(timeout=30.0, **SCREENSHOT)
    _check_fits(resp, SCREENSHOT)  # counted here from the PNG header the worker never saw
    assert resp.messages is not None and resp.messages[-1] is SCREENSHOT["messages"][0]
    assert resp.messages[-1]["content"][1] is part and part["image_url"]["url"] is url
    image = cc.openai_image_tokens(1000, 800, "high", model="gpt-4.1")
    text_only = [*resp.messages[:-1], {**resp.messages[-1], "content": resp.messages[-1]["content"][:1]}]
    assert image == 765 and resp.prompt_tokens == image + cc.openai_prompt_tokens(
        text_only, [], CATALOG.counter("o200k"), model="gpt-4.1")
    wire = measure(stack.frontend, SCREENSHOT)
    assert wire.request_before > 3_000_000 and wire.request_after < 2_000
    assert wire.reply_before > 3_000_000 and wire.reply_after < 64_000  # memories and decisions, no image


async def test_a_degraded_screenshot_call_returns_the_callers_image() -> None:
    async with AsyncClient(f"tcp://127.0.0.1:{free_port()}") as c:  # the broker is down
        await c.prepare_fallback()
        resp = await c.assemble_or_degrade(timeout=0.2, fallback_directive="Be brief.", **SCREENSHOT)
    assert resp.degraded and resp.messages is not None
    assert resp.messages[-1] is SCREENSHOT["messages"][0] and resp.prompt_tokens is not None
    assert resp.prompt_tokens > cc.openai_image_tokens(1000, 800, "high", model="gpt-4.1")


async def test_a_chat_request_over_the_limit_names_the_callers_field() -> None:
    async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", settings=Settings(max_request_bytes=1 << 20)) as c:
        with pytest.raises(InvalidRequest) as info:
            await c.assemble_or_degrade(timeout=5.0, **TRIAL)
    assert info.value.field == "messages" and "send less in messages" in info.value.message
    assert "recent_messages" not in info.value.message and "tool_schemas" not in info.value.message
