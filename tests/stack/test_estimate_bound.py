"""The token estimate is an upper bound on every exact encoder the service ships.

Families without a shipped vocabulary (Claude, Gemini, Mistral; Llama 3 and Qwen in the client's
fallback) are budgeted with ``estimate_tokens``; the service promises never to go over the window,
so on any text the estimate must be at least what o200k_base, cl100k_base, llama3 and qwen3 count.
The property tests generate adversarial text (whitespace and control runs, punctuation chains,
numbers in every script, emoji, CJK, base64, text that NFC changes, random Unicode) and natural
text; the hand cases pin texts that cost far more tokens than their words suggest; the structure
tests check the vocabulary facts the bound's argument rests on (``pipeline.counting.tokens.token_bound``);
the pipeline and stack tests send Claude, Gemini and Mistral requests whose history or memories
are mostly whitespace, offline and through the real broker and worker.

Here: the checks through running servers; the pure parts are in
tests/unit/test_estimate_bound.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.errors import ContextOverflow
from tests.helpers import start_stack
from tests.unit.test_estimate_bound import CATALOG, WHITE_TURN, _limit, _o200k_prompt, _whitespace_history  # noqa: F401  (fixtures and helpers the unit half defines)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_TIMEOUT": "5000", "IBEX_CONTEXT_DEADLINE_MS": "5000"}
    s = start_stack(tmp_path_factory.mktemp("bound"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


async def test_claude_whitespace_history_through_the_stack(stack: LocalStack) -> None:
    """claude-sonnet-4 (200K window) with ~250K o200k tokens of whitespace turns: the service trims
    the oldest turns, and its reported count is at least the exact o200k count of what it emits."""
    msgs = _whitespace_history(2) + _whitespace_history(1)[:-1] + [{"role": "user", "content": "The amount?"}]
    system = "You are Acme's support agent."
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(org_id="acme", agent_id="support-bot", model="anthropic/claude-sonnet-4",
                                query="invoice amount", format="anthropic", system=system, messages=msgs,
                                timeout=10.0)
        assert not resp.degraded and resp.messages is not None and resp.prompt_tokens is not None
        exact = _o200k_prompt(resp, "claude-sonnet-4", "anthropic")
        assert exact > 50_000  # whitespace turns were kept, and are counted
        assert resp.prompt_tokens >= exact and exact <= _limit(resp)
        assert resp.history and resp.history[0].index == 0  # the oldest went first
        with pytest.raises(ContextOverflow):  # one turn alone over the window is refused, not sent
            await c.assemble_or_degrade(org_id="acme", agent_id="support-bot", model="claude-sonnet-4",
                                        query="q", format="anthropic",
                                        messages=[{"role": "user", "content": " \t" * 210_000}], timeout=10.0)
