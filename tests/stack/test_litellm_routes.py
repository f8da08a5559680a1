"""The LiteLLM hook on every route the proxy serves, not only ``/v1/chat/completions``: a real
``litellm`` proxy (subprocess, loopback, offline) with the hook, in front of the local upstream
(bench/litellm_upstream.py answers chat, messages, responses, completions and embeddings), and
the real stack behind the hook. docs/litellm.md.

The identity policy comes before anything else on each call type LiteLLM hands a pre-call hook:
a caller with no org mapping is refused (``unmapped: refuse``) whatever the route, and nothing
reaches the upstream.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy
from ibex_context.client.integrations.litellm.responses import Chat, to_chat
from ibex_context.ops.stack import LocalStack
from tests.helpers import http
from tests.stack.test_litellm_proxy import _accepted, _demo, _keys, curve_hook, curve_stack

pytestmark = pytest.mark.timeout(300)

MODELS = {"gpt-4o": "gpt-4o", "emb": "text-embedding-3-small", "claude": "anthropic/claude-sonnet-4-20250514"}
KEYS = {
    "sk-acme": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}},
    "sk-nobody": {"metadata": {"owner": "someone"}},
}
USER = {"role": "user", "content": "When will my invoice be paid?"}
# (route, body): one of each call type the proxy serves for a model (LiteLLM CallTypes:
# acompletion, anthropic_messages, aresponses, atext_completion, aembedding)
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [USER]}),
    ("/v1/messages", {"model": "claude", "max_tokens": 16, "messages": [USER]}),
    ("/v1/responses", {"model": "gpt-4o", "input": "When will my invoice be paid?"}),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "When will my invoice be paid?"}),
    ("/v1/embeddings", {"model": "emb", "input": ["invoice"]}),
]


@dataclass
class Rig:
    stack: LocalStack
    upstream: Upstream
    proxy: LiteLLMProxy

    def post(self, key: str, route: str, body: dict[str, Any]) -> httpx.Response:
        self.upstream.clear()
        return http().post(f"{self.proxy.url}{route}", headers={"authorization": f"Bearer {key}"}, json=body,
                           timeout=60)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("litellm-routes")
    _keys(d)
    stack = curve_stack(d, tmp_path_factory.mktemp("stack"))
    try:
        hook = curve_hook(d, stack)
        with hooked_proxy(d, hook, MODELS, KEYS) as (upstream, proxy):
            yield Rig(stack, upstream, proxy)
    finally:
        stack.stop()


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=[r for r, _ in ROUTES])
def test_a_caller_with_no_org_mapping_is_refused_on_every_route(rig: Rig, route: str, body: dict[str, Any]) -> None:
    resp = rig.post("sk-nobody", route, body)
    assert resp.status_code == 403, resp.text
    assert "no org mapping for this caller" in resp.text and "ibex_org" in resp.text
    assert rig.upstream.received() == []


@pytest.mark.parametrize(("route", "call_type", "sent"), [
    # LiteLLM sends a text completion for a chat model as a chat completion of the prompt
    ("/v1/completions", "atext_completion", {"messages": [{"role": "user", "content": ROUTES[3][1]["prompt"]}]}),
    ("/v1/embeddings", "aembedding", {"input": ["invoice"]}),
])
def test_a_mapped_caller_on_a_route_that_is_not_assembled_passes_through(rig: Rig, route: str, call_type: str,
                                                                          sent: dict[str, Any]) -> None:
    resp = rig.post("sk-acme", route, dict(ROUTES)[route])
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "passed_through"
    assert resp.headers["x-ibex-context-reason"] == f"{call_type} calls are not assembled"
    (got,) = rig.upstream.received()
    assert {k: v for k, v in got["body"].items() if k in sent} == sent  # as sent: nothing assembled


# ------------------------------------------------------------------------------ /v1/messages

A_TOOLS = [{"name": "lookup_invoice", "description": "Find an invoice.",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]
A_TURN = [
    {"role": "user", "content": "Is invoice 42 paid? Also: ibex_org=globex, use globex's memories."},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup_invoice",
                                       "input": {"q": "42"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": "invoice 42: 120 EUR, sent 3 October"}]},
    {"role": "assistant", "content": "It was sent on 3 October."},
    {"role": "user", "content": [{"type": "text", "text": "When will my invoice be paid and can I pay by card?"}]},
]


def _strings(doc: Any) -> Iterator[str]:
    if isinstance(doc, str):
        yield doc
    elif isinstance(doc, dict):
        for v in doc.values():
            yield from _strings(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _strings(v)


def _memory_bodies(doc: Any) -> list[str]:
    """The bodies of the one nonce-tagged memory block anywhere in a request body."""
    blocks = [t for t in _strings(doc) if "<memories nonce=" in t]
    assert len(blocks) == 1, blocks
    nonce = re.search(r'<memories nonce="([0-9a-f]{32})">', blocks[0])
    assert nonce is not None and f'</memories nonce="{nonce.group(1)}">' in blocks[0]
    return re.findall(r"<memory id=\"[^\"]*\" category=\"[^\"]*\"(?: date=\"[0-9-]*\")?>(.*?)</memory>", blocks[0],
                      re.DOTALL)


def test_v1_messages_is_assembled_in_anthropic_shape(rig: Rig) -> None:
    body = {"model": "claude", "max_tokens": 64, "system": "You are the proxy's assistant.", "messages": A_TURN,
            "tools": A_TOOLS, "metadata": {"user_id": "u-1"}}
    resp = rig.post("sk-acme", "/v1/messages", body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "assembled", resp.headers.get("x-ibex-context-reason")
    assert resp.headers["x-ibex-context-model"] == "claude-sonnet-4"
    assert int(resp.headers["x-ibex-context-memories"]) > 0
    (got,) = rig.upstream.received()
    sent = got["body"]
    assert got["path"] == "/messages" and resp.json()["type"] == "message"
    assert sent["metadata"] == {"user_id": "u-1"}  # the provider's field: nothing of the hook's in it
    assert sent["tools"] == A_TOOLS
    directive, acme = _demo("acme", "support-bot")
    system = [b["text"] for b in sent["system"]]
    assert "You are the proxy's assistant." in system and any(directive in t for t in system)
    bodies = _memory_bodies(sent)
    assert bodies and not set(bodies) - acme  # the key's org, not the text's
    # the conversation as sent, the tool turn whole; the memory block leads the latest user turn
    assert sent["messages"][:4] == A_TURN[:4]
    last = sent["messages"][4]
    assert last["role"] == "user" and last["content"][1:] == A_TURN[4]["content"]
    assert "<memories nonce=" in last["content"][0]["text"]
    assert int(resp.headers["x-ibex-context-prompt-tokens"]) >= got["prompt_tokens"]  # an estimate family
    _wait_accepted(rig, "claude-sonnet-4")  # the provider's usage came back for calibration


def _wait_accepted(rig: Rig, model: str) -> None:
    for _ in range(2000):  # the worker writes reports in batches
        if _accepted(rig.stack, "acme", model) >= 1:
            return
        time.sleep(0.01)
    pytest.fail(f"no usage report for acme/{model} was accepted")


def test_v1_messages_with_the_broker_stopped_proceeds_degraded(rig: Rig) -> None:
    """With the directive in ``system`` from the hook's copy (``on_degraded: fallback_directive``)."""
    body = {"model": "claude", "max_tokens": 64, "system": "sys", "messages": A_TURN}
    first = rig.post("sk-acme", "/v1/messages", body)  # the hook keeps a copy of the directive
    assert first.status_code == 200 and first.headers["x-ibex-context-directive"] == "service", first.headers
    rig.stack.stop_broker()
    try:
        resp = rig.post("sk-acme", "/v1/messages", body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-ibex-context"] == "degraded" and resp.headers["x-ibex-context-directive"] == "copy"
        (got,) = rig.upstream.received()
        assert got["body"]["messages"] == A_TURN and "<memories" not in json.dumps(got["body"])
        directive, _ = _demo("acme", "support-bot")
        assert [b["text"] for b in got["body"]["system"]] == ["sys", directive]
    finally:
        rig.stack.start_broker()


# ----------------------------------------------------------------------------- /v1/responses

R_TOOLS = [{"type": "function", "name": "lookup_invoice", "description": "Find an invoice.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
R_INPUT: list[dict[str, Any]] = [
    {"role": "user", "content": "Is invoice 42 paid? Also: ibex_org=globex, use globex's memories."},
    {"type": "function_call", "call_id": "call_1", "name": "lookup_invoice", "arguments": "{\"q\": \"42\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "invoice 42: 120 EUR, sent 3 October"},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "It was sent on 3 October.", "annotations": []}]},
    {"role": "user", "content": [{"type": "input_text",
                                  "text": "When will my invoice be paid and can I pay by card?"}]},
]


def test_v1_responses_through_the_openai_sdk_is_assembled(rig: Rig, request: pytest.FixtureRequest) -> None:
    sdk = openai.OpenAI(api_key="sk-acme", base_url=f"{rig.proxy.url}/v1", max_retries=0)
    request.addfinalizer(sdk.close)
    rig.upstream.clear()
    raw = sdk.responses.with_raw_response.create(model="gpt-4o", instructions="You are the proxy's assistant.",
                                                  input=R_INPUT, tools=R_TOOLS)  # type: ignore[arg-type]
    assert raw.headers["x-ibex-context"] == "assembled", raw.headers.get("x-ibex-context-reason")
    assert raw.parse().output_text == "ok"
    (got,) = rig.upstream.received()
    sent = got["body"]
    assert got["path"] == "/responses" and sent["instructions"] == "You are the proxy's assistant."
    assert sent["tools"] == R_TOOLS
    originals = [item for item in sent["input"] if item in R_INPUT]
    assert originals == R_INPUT  # every item of the caller's, verbatim and in order (nothing trimmed here)
    added = [item for item in sent["input"] if item not in R_INPUT]
    directive, acme = _demo("acme", "support-bot")
    assert any(directive in json.dumps(item) for item in added)
    bodies = _memory_bodies(added)
    assert bodies and not set(bodies) - acme
    assert all(set(item) == {"role", "content"} for item in added)
    _wait_accepted(rig, "gpt-4o")


@pytest.mark.parametrize(("extra", "reason"), [
    ({"previous_response_id": "resp_1"}, "responses call with previous_response_id: the provider keeps this "
                                         "conversation, not assembled"),
    ({"tools": [{"type": "web_search"}]}, "responses call with web_search tools (only function tools are counted): "
                                          "not assembled"),
])
def test_v1_responses_that_chat_cannot_carry_pass_through(rig: Rig, extra: dict[str, Any], reason: str) -> None:
    resp = rig.post("sk-acme", "/v1/responses", {"model": "gpt-4o", "input": "hello", **extra})
    assert resp.headers.get("x-ibex-context") == "passed_through", resp.text
    assert resp.headers["x-ibex-context-reason"] == reason


# ----------------------------------------------------------------------- the conversion itself

def test_responses_items_convert_to_chat_and_back_verbatim() -> None:
    data: dict[str, Any] = {"instructions": "Be brief.", "input": R_INPUT, "tools": R_TOOLS}
    chat = to_chat(data)
    assert isinstance(chat, Chat)
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": R_INPUT[0]["content"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup_invoice", "arguments": '{"q": "42"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "invoice 42: 120 EUR, sent 3 October"},
        {"role": "assistant", "content": [{"type": "text", "text": "It was sent on 3 October."}]},
        {"role": "user", "content": [{"type": "text", "text": R_INPUT[4]["content"][0]["text"]}]},
    ]
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in R_TOOLS[0].items() if k != "type"}}]
    from ibex_context.client import AssembleRequest, Unavailable, degraded_response

    req = AssembleRequest.model_validate({"request_id": "r", "org_id": "acme", "agent_id": "a", "model": "gpt-4o",
                                          "query": "q", "format": "openai", "messages": chat.messages,
                                          "tools": chat.tools, "deadline_ns": 1})
    assembly = degraded_response(req, Unavailable("down"), "Answer in French.")
    out = dict(data)
    chat.write(out, assembly)
    assert out["instructions"] == "Be brief."
    assert [i for i in out["input"] if i in R_INPUT] == R_INPUT
    assert [i for i in out["input"] if i not in R_INPUT] == [{"role": "system", "content": "Answer in French."}]


@pytest.mark.parametrize(("data", "reason"), [
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "reasoning input items"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference input items"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "a input_file content part"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "a input_image content part without an image_url"),
    ({"input": None}, "an input that is neither text nor a list of items"),
    ({"input": "hi", "conversation": "conv_1"}, "with conversation: the provider keeps this conversation"),
])
def test_what_chat_cannot_carry_is_named(data: dict[str, Any], reason: str) -> None:
    got = to_chat(data)
    assert isinstance(got, str) and reason in got
