"""The providers' own SDKs through a real LiteLLM proxy with the hook: ``anthropic``'s
``messages.create`` and ``messages.stream`` on ``/v1/messages``, ``openai``'s ``responses.create``
(streamed too) on ``/v1/responses``, in front of the local upstream (bench/litellm_upstream.py,
which streams in each API's own events) and the real stack behind the hook (CURVE keys, one per
org, demo data). docs/litellm.md.

What reaches the upstream is the assembled request (the org's directive and memories, trimmed to
the window when the conversation is over it), the caller gets the provider's answer (each stream
event intact) with the ``x-ibex-context*`` headers, and the provider's usage comes back to the
service for calibration, streamed or not. A key with no org mapping is refused on every route.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from bench.litellm_rig import hooked_proxy
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from tests.stack.test_litellm_proxy import _accepted, _demo, _keys, curve_hook, curve_stack
from tests.stack.test_litellm_routes import A_TOOLS, A_TURN, R_INPUT, R_TOOLS, Rig, _memory_bodies

pytestmark = pytest.mark.timeout(300)

MODELS = {"gpt-4o": "gpt-4o", "small": "gpt-4", "claude": "anthropic/claude-sonnet-4-20250514"}
KEYS = {"sk-acme": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}},
        "sk-nobody": {"metadata": {"owner": "someone"}}}
CATALOG = Catalog.load()
SYSTEM = "You are the proxy's assistant."


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("litellm-sdks")
    _keys(d)
    stack = curve_stack(d, tmp_path_factory.mktemp("stack"))
    try:
        hook = curve_hook(d, stack)
        with hooked_proxy(d, hook, MODELS, KEYS) as (upstream, proxy):
            yield Rig(stack, upstream, proxy)
    finally:
        stack.stop()


_opened: list[anthropic.Anthropic | openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_sdks() -> Iterator[None]:
    """The SDK clients a test made are closed after it: their connection pools hold sockets."""
    yield
    while _opened:
        _opened.pop().close()


def _anthropic(rig: Rig, key: str = "sk-acme") -> anthropic.Anthropic:
    rig.upstream.clear()
    sdk = anthropic.Anthropic(api_key=key, base_url=rig.proxy.url, max_retries=0, timeout=120)
    _opened.append(sdk)
    return sdk


def _openai(rig: Rig, key: str = "sk-acme") -> openai.OpenAI:
    rig.upstream.clear()
    sdk = openai.OpenAI(api_key=key, base_url=f"{rig.proxy.url}/v1", max_retries=0, timeout=120)
    _opened.append(sdk)
    return sdk


def _reported(rig: Rig, model: str) -> Callable[[], None]:
    """A check that one more usage report for acme/``model`` was accepted than now."""
    before = _accepted(rig.stack, "acme", model)

    def wait() -> None:
        for _ in range(2000):  # the worker writes reports in batches
            if _accepted(rig.stack, "acme", model) > before:
                return
            time.sleep(0.01)
        pytest.fail(f"no usage report for acme/{model} was accepted")
    return wait


def _assembled(headers: Any, model: str) -> None:
    """The hook's headers on an assembled call."""
    assert headers["x-ibex-context"] == "assembled", headers.get("x-ibex-context-reason")
    assert headers["x-ibex-context-model"] == model and headers["x-ibex-context-directive"] == "service"
    assert int(headers["x-ibex-context-memories"]) > 0 and int(headers["x-ibex-context-prompt-tokens"]) > 0
    assert headers["x-ibex-context-request-id"]


def _anthropic_sent(rig: Rig) -> dict[str, Any]:
    """The one request the upstream received, checked to carry acme's directive and memories."""
    (got,) = rig.upstream.received()
    sent: dict[str, Any] = got["body"]
    assert got["path"] == "/messages"
    directive, acme = _demo("acme", "support-bot")
    system = [b["text"] for b in sent["system"]]
    assert SYSTEM in system and any(directive in t for t in system)
    bodies = _memory_bodies(sent["messages"])
    assert bodies and not set(bodies) - acme  # the key's org, whatever the text says
    return got


def _long_turns(n: int, words: int) -> list[dict[str, Any]]:
    turns = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"turn {i} about invoice {i}: " + "the payment terms and the delivery dates " * words}
             for i in range(n)]
    turns[-1] = {"role": "user", "content": "When will my invoice be paid and can I pay by card?"}
    return turns


# ------------------------------------------------------------------------ anthropic: /v1/messages

def test_anthropic_sdk_messages_create_is_assembled(rig: Rig) -> None:
    sdk = _anthropic(rig)
    report = _reported(rig, "claude-sonnet-4")
    raw = sdk.messages.with_raw_response.create(model="claude", max_tokens=64, system=SYSTEM,
                                                messages=A_TURN, tools=A_TOOLS)  # type: ignore[arg-type]
    _assembled(raw.headers, "claude-sonnet-4")
    msg = raw.parse()
    assert [b.text for b in msg.content if b.type == "text"] == ["ok"]
    got = _anthropic_sent(rig)
    assert got["body"]["tools"] == A_TOOLS and got["body"]["messages"][:4] == A_TURN[:4]
    assert msg.usage.input_tokens == got["prompt_tokens"]  # the provider's answer, as it sent it
    report()


def test_anthropic_sdk_messages_stream_is_assembled_and_reports_usage(rig: Rig) -> None:
    sdk = _anthropic(rig)
    report = _reported(rig, "claude-sonnet-4")
    with sdk.messages.stream(model="claude", max_tokens=64, system=SYSTEM,
                             messages=A_TURN) as stream:  # type: ignore[arg-type]
        _assembled(stream.response.headers, "claude-sonnet-4")
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    assert [b.text for b in final.content if b.type == "text"] == ["ok"] and final.stop_reason == "end_turn"
    got = _anthropic_sent(rig)
    assert got["body"]["stream"] is True
    assert final.usage.input_tokens == got["prompt_tokens"] and final.usage.output_tokens == 1
    report()


def test_anthropic_sdk_stream_true_reaches_the_caller_intact(rig: Rig) -> None:
    sdk = _anthropic(rig)
    report = _reported(rig, "claude-sonnet-4")
    raw = sdk.messages.with_raw_response.create(model="claude", max_tokens=64, system=SYSTEM, messages=A_TURN,
                                                stream=True)  # type: ignore[arg-type]
    _assembled(raw.headers, "claude-sonnet-4")
    events = list(raw.parse())
    got = _anthropic_sent(rig)
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == got["prompt_tokens"]  # type: ignore[union-attr]
    assert events[2].delta.text == "ok"  # type: ignore[union-attr]
    report()


def test_anthropic_sdk_conversation_over_the_window_is_trimmed(rig: Rig) -> None:
    """~1.3 MB of turns on claude-sonnet-4 (200K tokens): trimmed to fit, the latest turn kept."""
    turns = _long_turns(200, 800)
    sdk = _anthropic(rig)
    raw = sdk.messages.with_raw_response.create(model="claude", max_tokens=64, system=SYSTEM,
                                                messages=turns)  # type: ignore[arg-type]
    _assembled(raw.headers, "claude-sonnet-4")
    got = _anthropic_sent(rig)
    spec = CATALOG.model("claude-sonnet-4")
    assert got["prompt_tokens"] <= int(raw.headers["x-ibex-context-prompt-tokens"])  # an estimate family
    assert got["prompt_tokens"] <= spec.context_window - response_reserve(spec)
    kept = [m for m in got["body"]["messages"] if m in turns]
    assert 1 < len(kept) < len(turns) and kept == [m for m in turns if m in kept]
    assert got["body"]["messages"][-1]["content"][-1]["text"] == turns[-1]["content"]


# ------------------------------------------------------------------------ openai: /v1/responses

def _responses_sent(rig: Rig) -> dict[str, Any]:
    (got,) = rig.upstream.received()
    assert got["path"] == "/responses" and got["body"]["instructions"] == SYSTEM
    directive, acme = _demo("acme", "support-bot")
    added = [item for item in got["body"]["input"] if item not in R_INPUT]
    assert any(directive in json.dumps(item) for item in added)
    bodies = _memory_bodies(added)
    assert bodies and not set(bodies) - acme
    return got


def test_openai_sdk_responses_stream_is_assembled_and_reports_usage(rig: Rig) -> None:
    sdk = _openai(rig)
    report = _reported(rig, "gpt-4o")
    raw = sdk.responses.with_raw_response.create(model="gpt-4o", instructions=SYSTEM, input=R_INPUT,  # type: ignore[arg-type]
                                                  tools=R_TOOLS, stream=True)  # type: ignore[arg-type]
    _assembled(raw.headers, "gpt-4o")
    events = list(raw.parse())
    got = _responses_sent(rig)
    assert got["body"]["stream"] is True and got["body"]["tools"] == R_TOOLS
    assert [item for item in got["body"]["input"] if item in R_INPUT] == R_INPUT  # verbatim, in order
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "ok"  # type: ignore[union-attr]
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == "ok" and done.usage is not None and done.usage.input_tokens == got["prompt_tokens"]
    report()


def test_openai_sdk_responses_over_the_window_are_trimmed(rig: Rig) -> None:
    """A long conversation on gpt-4 (8K): trimmed to fit, the caller's items verbatim and in order."""
    items: list[dict[str, Any]] = _long_turns(40, 60)
    sdk = _openai(rig)
    report = _reported(rig, "gpt-4")
    raw = sdk.responses.with_raw_response.create(model="small", instructions=SYSTEM, input=items)  # type: ignore[arg-type]
    _assembled(raw.headers, "gpt-4")
    assert raw.parse().output_text == "ok"
    (got,) = rig.upstream.received()
    kept = [item for item in got["body"]["input"] if item in items]
    assert 1 < len(kept) < len(items) and kept == [i for i in items if i in kept] and kept[-1] == items[-1]
    spec = CATALOG.model("gpt-4")
    # the upstream bills the input items' JSON (bench/litellm_upstream.py): a bound, not the chat count
    assert int(raw.headers["x-ibex-context-prompt-tokens"]) <= spec.context_window - response_reserve(spec)
    report()


# ------------------------------------------------------------------- no org mapping: every route

def _calls(rig: Rig) -> list[tuple[str, Callable[[], Any]]]:
    a, o = _anthropic(rig, "sk-nobody"), _openai(rig, "sk-nobody")
    user = [{"role": "user", "content": "When will my invoice be paid?"}]

    def a_stream() -> None:
        with a.messages.stream(model="claude", max_tokens=16, messages=user) as s:  # type: ignore[arg-type]
            list(s)

    return [
        ("messages.create", lambda: a.messages.create(model="claude", max_tokens=16, messages=user)),  # type: ignore[arg-type]
        ("messages.stream", a_stream),
        ("messages stream=True", lambda: list(a.messages.create(model="claude", max_tokens=16, messages=user,  # type: ignore[arg-type]
                                                                stream=True))),
        ("responses.create", lambda: o.responses.create(model="gpt-4o", input="When will my invoice be paid?")),
        ("responses stream=True", lambda: list(o.responses.create(model="gpt-4o", input="hi", stream=True))),
        ("chat.completions.create", lambda: o.chat.completions.create(model="gpt-4o", messages=user)),  # type: ignore[arg-type]
        ("chat stream=True", lambda: list(o.chat.completions.create(model="gpt-4o", messages=user,  # type: ignore[arg-type]
                                                                    stream=True))),
        ("completions.create", lambda: o.completions.create(model="gpt-4o", prompt="hi")),
        ("embeddings.create", lambda: o.embeddings.create(model="gpt-4o", input=["invoice"])),
    ]


def test_an_unmapped_key_is_refused_on_every_route_by_both_sdks(rig: Rig) -> None:
    for name, call in _calls(rig):
        with pytest.raises((anthropic.PermissionDeniedError, openai.PermissionDeniedError)) as caught:
            call()
        assert "no org mapping for this caller" in str(caught.value), (name, caught.value)
        assert rig.upstream.received() == [], name
