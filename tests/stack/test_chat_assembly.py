"""Chat-native assembly end to end through the one pipeline (offline) and the real stack.

The conversation goes in in the provider's shape and comes back ready to send: the directive and
the nonce-tagged memories placed, tool calls and images untouched, history trimmed in whole units,
and the exact count of the emitted prompt never over window - response reserve.

Here: the checks through running servers; the pure parts are in
tests/unit/test_chat_assembly.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.errors import ContextOverflow
from tests.helpers import start_stack
from tests.unit.test_chat_assembly import AGENT_TURN, CALL, IMAGE, TOOLS, _limit  # noqa: F401  (fixtures and helpers the unit half defines)

# --------------------------------------------------------------------------- the real stack

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
    s = start_stack(tmp_path_factory.mktemp("chat"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


async def test_a_proxy_turn_through_the_stack(stack: LocalStack, tmp_path: Path) -> None:
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(org_id="acme", agent_id="support-bot", model="openai/gpt-4o",
                                query="invoice amount", format="openai", messages=AGENT_TURN, tools=TOOLS,
                                timeout=5.0)
        assert not resp.degraded and resp.messages is not None and resp.prompt_tokens is not None
        directive = resp.messages[1]
        assert directive["role"] == "system" and "Acme" in directive["content"]  # acme's directive, from Redis
        assert f'nonce="{resp.nonce}"' in resp.messages[-2]["content"] and resp.packed
        assert resp.messages[3]["tool_calls"] == [CALL] and resp.prompt_tokens <= _limit(resp)
        with pytest.raises(ContextOverflow):
            await c.assemble_or_degrade(org_id="acme", agent_id="support-bot", model="gpt-4o", query="q",
                                        format="openai", messages=[{"role": "user", "content": "w " * 140_000}],
                                        timeout=5.0)


async def test_degraded_chat_reply_is_provider_ready_and_within_the_window() -> None:
    from ibex_context.ops.stack import free_port

    async with AsyncClient(f"tcp://127.0.0.1:{free_port()}") as c:  # nobody listens there
        await c.prepare_fallback()
        resp = await c.assemble_or_degrade(org_id="acme", agent_id="support-bot", model="gpt-4o", query="q",
                                           format="openai", messages=AGENT_TURN, tools=TOOLS, timeout=0.05)
    assert resp.degraded and resp.messages is not None and resp.prompt_tokens is not None
    assert resp.messages[0] == AGENT_TURN[0] and resp.messages[-1] == AGENT_TURN[-1]
    assert resp.packed == [] and resp.prompt_tokens <= _limit(resp)
