"""Context editing: old tool uses cleared before any turn is dropped, and Anthropic thinking counted
as the provider counts it (docs/assembly.md "Context editing").

Pure tests of the planner and the pipeline (offline ``assemble``), properties over generated
tool-heavy agent conversations in both provider forms, and one real-stack test through the worker.

Here: the checks through running servers; the pure parts are in
tests/unit/test_context_editing.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.editing import ContextEditing
from tests.helpers import start_stack
from tests.unit.test_context_editing import (  # noqa: F401
    A_TOOLS,
    NAMES,
    TOOLS,
    _agent,
    _is_placeholder,
    _limit,
    _pairs_valid,
    _result,
    _sent_results,
    _turns_kept,
    _uses,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
    s = start_stack(tmp_path_factory.mktemp("ctxedit"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


async def test_tool_heavy_agent_through_the_worker_keeps_more_turns(stack: LocalStack) -> None:
    convo = _agent(12)
    async with AsyncClient(stack.frontend) as c:
        common: dict[str, Any] = {"org_id": "acme", "agent_id": "support-bot", "model": "gpt-4", "query": "topic",
                                  "format": "openai", "messages": convo, "tools": TOOLS, "timeout": 5.0}
        drop_only = await c.assemble(**common, history={"context_editing": ContextEditing(enabled=False)})
        cleared = await c.assemble(**common)
    assert not cleared.degraded and cleared.messages is not None and drop_only.messages is not None
    assert _turns_kept(cleared.messages) > _turns_kept(drop_only.messages)
    assert cleared.prompt_tokens is not None and cleared.prompt_tokens <= _limit(cleared)
    _pairs_valid("openai", cleared.messages)
    # the client rebuilt the cleared messages from the caller's own conversation and the layout
    sent = _sent_results("openai", cleared.messages)
    assert any(_is_placeholder(v) for v in sent.values())
    assert any(e.action == "cleared" and e.tokens > 0 for e in cleared.edits)
