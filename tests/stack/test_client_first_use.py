"""What a new user of the client library meets first (README "The client library"): a deadline
too short to send is DeadlineExceeded, not a broker fault; a chat request needs no query; the
default timeout grows with the conversation; and a fallback keeps the agent's directive."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench.wire_size import conversation
from ibex_context.client import AssembleRequest, AsyncClient, DeadlineExceeded, InvalidRequest, SyncClient
from ibex_context.client.degrade import fetched_directive
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.chat_query import last_user_text
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(300)

AGENT = {"org_id": "acme", "agent_id": "support-bot"}
ONE_MB = conversation(300, 600, seed=7)  # ~1.1 MB of text in 300 turns


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("stack"), workers=1)
    try:
        yield s
    finally:
        s.stop()


# ------------------------------------------------------------------- deadlines too short to send


@pytest.mark.parametrize("timeout_ms", ["1", "2", "5", "0.001"])
def test_cli_short_deadline_is_one_line_deadline_exceeded(stack: LocalStack, timeout_ms: str) -> None:
    args = ["assemble", "--org", "acme", "--agent", "support-bot", "--query", "invoice",
            "--endpoint", stack.frontend, "--timeout-ms", timeout_ms]
    out = subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args],
                         capture_output=True, text=True, timeout=60, check=False)
    if float(timeout_ms) >= 5 and out.returncode == 0:  # an idle machine can answer in 5 ms (degraded)
        assert out.stderr == "" and "request " in out.stdout, out.stdout
        return
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ibex-context assemble: DEADLINE_EXCEEDED: "), out.stderr
    # a new client is mostly still connecting when 5 ms are over (said: "too short to send"); one
    # that connected and sent in time says the deadline passed waiting for the reply
    assert "UNAVAILABLE" not in out.stderr and "cannot send to broker" not in out.stderr, out.stderr


async def test_a_new_client_with_a_tiny_deadline_says_the_deadline_was_too_short(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:  # fresh: still connecting
        with pytest.raises(DeadlineExceeded):  # (or, connected in time, sent: too short for the reply)
            await c.assemble(query="invoice", model="gpt-4o", timeout=0.001, **AGENT)
    async with AsyncClient(stack.frontend) as c:
        with pytest.raises(DeadlineExceeded, match="deadline was too short to send the request"):
            await c.assemble(query="invoice", model="gpt-4o", timeout=1e-6, **AGENT)
    async with AsyncClient(stack.frontend) as c:  # connected: the deadline passes before the first try
        await c.wait_connected()
        with pytest.raises(DeadlineExceeded, match="too short to send the request"):
            await c.assemble(query="invoice", model="gpt-4o", timeout=1e-7, **AGENT)
        resp = await c.assemble(query="invoice", model="gpt-4o", timeout=2.0, **AGENT)  # and then it works
        assert resp.request_id


def test_sync_client_short_deadline(stack: LocalStack) -> None:
    with SyncClient(stack.frontend) as c:
        with pytest.raises(DeadlineExceeded):
            c.assemble(query="invoice", model="gpt-4o", timeout=0.001, **AGENT)
        with pytest.raises(DeadlineExceeded, match="too short to send"):
            c.assemble(query="invoice", model="gpt-4o", timeout=1e-7, **AGENT)


async def test_a_broker_that_refuses_connections_is_still_unavailable() -> None:
    from ibex_context.client import Unavailable
    from ibex_context.ops.stack import free_port

    async with AsyncClient(f"tcp://127.0.0.1:{free_port()}") as c:
        with pytest.raises(Unavailable):
            await c.assemble(query="invoice", model="gpt-4o", timeout=0.1, **AGENT)


# ------------------------------------------------------------------------ query in chat form


@pytest.mark.parametrize("form", ["openai", "anthropic"])
def test_chat_form_query_is_the_latest_user_text(form: str) -> None:
    tail: Any = ("When is my invoice due?" if form == "openai" else
                 [{"type": "text", "text": "When is my invoice due?"}, {"type": "text", "text": "Thanks."}])
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": tail}]
    req = AssembleRequest(request_id="r", model="gpt-4o", format=form, messages=messages, deadline_ns=1, **AGENT)
    assert req.query == last_user_text(messages) and req.query.startswith("When is my invoice due?")
    given = AssembleRequest(request_id="r", model="gpt-4o", format=form, messages=messages, query="", deadline_ns=1,
                            **AGENT)
    assert given.query == ""  # a query the caller gives is kept, even an empty one


async def test_chat_assembly_without_query_retrieves_for_the_conversation(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        resp = await c.assemble(model="gpt-4o", format="openai", timeout=2.0, **AGENT,
                                messages=[{"role": "user", "content": "How do refunds for my invoice work?"}])
        assert resp.branches["cold"].status == "success", resp.degraded_reasons
        with pytest.raises(InvalidRequest) as exc:  # the flat form still needs one, said in one line
            await c.assemble(model="gpt-4o", timeout=2.0, **AGENT)
        assert exc.value.field == "query" and "\n" not in exc.value.message


# --------------------------------------------------------------- default timeout and fallback


async def test_the_default_timeout_grows_with_the_conversation(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        big = AssembleRequest(request_id="r", model="gpt-4o", format="openai", messages=ONE_MB, deadline_ns=1,
                              **AGENT)
        short = AssembleRequest(request_id="r", model="gpt-4o", query="q", deadline_ns=1, **AGENT)
        assert c.call_timeout(short) == pytest.approx(c.default_timeout, abs=1e-3)
        assert c.call_timeout(big) > c.default_timeout + 0.4  # +400 ms per million characters
        t0 = time.monotonic()
        # no timeout given: the service answers (a DeadlineExceeded would raise here)
        resp = await c.assemble(model="gpt-4o", format="openai", messages=ONE_MB, **AGENT)
        assert resp.budget.model == "gpt-4o" and resp.messages, time.monotonic() - t0


@pytest.mark.parametrize("form", ["openai", "anthropic"])
async def test_the_fallback_keeps_the_directive_the_client_last_saw(stack: LocalStack, form: str) -> None:
    model = "gpt-4o" if form == "openai" else "claude-sonnet-4"
    async with AsyncClient(stack.frontend) as c:
        await c.prepare_fallback()
        await c.wait_connected()
        first = await c.assemble(model=model, query="invoice", timeout=2.0, **AGENT)
        directive = fetched_directive(first)
        assert directive
        resp = await c.assemble_or_degrade(model=model, format=form, messages=ONE_MB, timeout=1e-6, **AGENT)
        assert resp.degraded and resp.degraded_reasons[0].startswith("context service DEADLINE_EXCEEDED")
        assert any("the client's copy" in r for r in resp.degraded_reasons), resp.degraded_reasons
        section = next(s for s in resp.sections if s.name == "directive")
        assert directive in section.text
        prompt = str(resp.messages[0] if form == "openai" else resp.system)
        assert directive[:60] in prompt
        # a directive the caller passes wins over the copy
        own = await c.assemble_or_degrade(model=model, query="q", timeout=1e-6, fallback_directive="Mine.", **AGENT)
        assert next(s for s in own.sections if s.name == "directive").text.endswith("Mine.")
