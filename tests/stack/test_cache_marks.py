"""Anthropic allows four ``cache_control`` breakpoints per request, wherever they sit: the caller's
marks inside ``tool_result`` content count toward them like top-level ones, so the service adds
only what still fits (``pipeline.rendering.chat_render.add_breakpoints``). Real broker, worker, memory service
and Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(180)

LIMIT = 4  # https://docs.claude.com/en/docs/build-with-claude/prompt-caching
MARK = {"cache_control": {"type": "ephemeral"}}
TOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]
ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
       "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}


def conversation(nested: int) -> list[dict[str, Any]]:
    """A tool round whose result holds ``nested`` marked text blocks, then a user question."""
    result = [{"type": "text", "text": f"invoice line {i}", **MARK} for i in range(nested)]
    return [
        {"role": "user", "content": "Find my October invoice."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "lookup", "input": {"q": "oct"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                      "content": [*result, {"type": "text", "text": "total 120 EUR"}]}]},
        {"role": "assistant", "content": "It is invoice #42, 120 EUR."},
        {"role": "user", "content": "When was it sent?"},
    ]


def marks(value: Any) -> int:
    """Every ``cache_control`` in a request part, at any depth."""
    if isinstance(value, dict):
        return ("cache_control" in value) + sum(marks(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(marks(v) for v in value)
    return 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("cache-marks"), workers=1, env=ENV)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("nested", [0, 2, 3, 4])
async def test_nested_marks_count_toward_the_four(stack: LocalStack, nested: int) -> None:
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(org_id="acme", agent_id="support-bot", model="claude-sonnet-4",
                                query="invoice sent date", format="anthropic", messages=conversation(nested),
                                system=[{"type": "text", "text": "Be brief."}], tools=TOOLS,
                                options={"cache_breakpoints": True}, timeout=10.0)
    assert resp.messages is not None and resp.system is not None
    sent = marks(resp.messages) + marks(resp.system) + marks(TOOLS)
    added = min(2, LIMIT - nested)  # the system's last block and the turn before the question, as room allows
    assert len(resp.cache_breakpoints) == added, resp.cache_breakpoints
    assert sent == nested + added <= LIMIT
