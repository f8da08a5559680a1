"""The first degraded call honours its deadline too (README "The client library").

A fresh process (as a proxy starts) with the broker down: the client starts and at once calls
``assemble_or_degrade(timeout=0.05)``. The fallback's vocabularies are still loading on the
client's thread then, and the chat pipeline would be imported on first use; neither may hold
the call past its deadline. Before the vocabularies are there the fallback counts by UTF-8 bytes
(``ByteBoundCatalog``): never under the real count, so the trimmed conversation still fits.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_first_degraded.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ibex_context.client import AssembleRequest, Unavailable, degraded_response
from ibex_context.client.degrade import BYTE_BOUND_NOTE, ByteBoundCatalog, Fallback
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from ibex_context.pipeline.counting.chat_count import openai_prompt_tokens
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.errors import ContextOverflow

pytestmark = pytest.mark.timeout(120)
CATALOG = Catalog.load()


TEXTS = ["hello", "Is invoice 42 paid? 1234567890 " * 20, "日本語のテキスト、絵文字 🎉🎉", "a\u0301e\u0301" * 50,
         "def f(x):\n    return x ** 2\n" * 30, " " * 500, "ﬁ ﬂ ﬀ" * 40]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_byte_bound_never_undercounts(text: str) -> None:
    bound = ByteBoundCatalog.load()
    assert set(bound.families) == set(CATALOG.families)
    for family in CATALOG.families:  # exact families, and the estimates with their margins
        assert bound.counter(family).count(text) >= CATALOG.counter(family).count(text), family


def _turns(n: int, words: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "lorem ipsum dolor " * words}
            for i in range(n)]


def test_a_byte_bound_fallback_fits_the_window() -> None:
    """A long conversation degraded with byte counts still fits gpt-4's 8,192 by the exact count."""
    turns = _turns(24, 60)
    req = AssembleRequest.model_validate({"request_id": "r", "org_id": "acme", "agent_id": "a", "model": "gpt-4",
                                          "query": "q", "format": "openai", "messages": turns, "deadline_ns": 1})
    resp = degraded_response(req, Unavailable("down"), catalog=ByteBoundCatalog.load(), notes=[BYTE_BOUND_NOTE])
    assert resp.messages is not None and resp.messages[-1] == turns[-1] and len(resp.messages) < len(turns)
    spec = CATALOG.model("gpt-4")
    exact = openai_prompt_tokens(resp.messages, [], CATALOG.counter("cl100k"), model="gpt-4")
    assert resp.prompt_tokens is not None
    assert exact <= resp.prompt_tokens <= spec.context_window - response_reserve(spec)
    assert resp.prompt_tokens_kind == "estimate" and resp.degraded_reasons[1] == BYTE_BOUND_NOTE


async def test_over_the_window_by_the_byte_bound_waits_for_the_exact_count() -> None:
    """Pinned turns over the window by bytes but not by tokens: no refusal, the exact count decides
    (late: the vocabularies load first)."""
    turns = _turns(24, 300)  # the latest user turn and the reply: ~11K bytes, ~2.7K tokens
    req = AssembleRequest.model_validate({"request_id": "r", "org_id": "acme", "agent_id": "a", "model": "gpt-4",
                                          "query": "q", "format": "openai", "messages": turns, "deadline_ns": 1})
    with pytest.raises(ContextOverflow):
        degraded_response(req, Unavailable("down"), catalog=ByteBoundCatalog.load())
    fallback = Fallback(asyncio.get_running_loop(), Settings())
    assert not fallback.loaded.done()  # delivered to this loop, which has not run since
    resp = await fallback.respond(req, Unavailable("down"), None, time.monotonic() - 1)  # the deadline has passed
    assert fallback.loaded.done() and resp.budget.count_rule == "exact" and BYTE_BOUND_NOTE not in resp.degraded_reasons
    assert resp.messages is not None and resp.messages[-2:] == turns[-2:]


async def test_the_byte_bound_catalog_is_made_ready_on_the_loading_thread() -> None:
    """Not on the first call's path: built (and run once) before the vocabularies load."""
    fallback = Fallback(asyncio.get_running_loop(), Settings())
    await fallback.ready()
    assert isinstance(fallback._bytes, ByteBoundCatalog)
