"""The LiteLLM hook on every route the proxy serves, not only ``/v1/chat/completions``: a real
``litellm`` proxy (subprocess, loopback, offline) with the hook, in front of the local upstream
(bench/litellm_upstream.py answers chat, messages, responses, completions and embeddings), and
the real stack behind the hook. README "Using it from LiteLLM proxy".

The identity policy comes before anything else on each call type LiteLLM hands a pre-call hook:
a caller with no org mapping is refused (``unmapped: refuse``) whatever the route, and nothing
reaches the upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy
from ibex_context.ops.stack import LocalStack
from ibex_context.shared import auth
from tests.helpers import start_stack
from tests.test_litellm_proxy import ENV_FAST, _keys

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
        return httpx.post(f"{self.proxy.url}{route}", headers={"authorization": f"Bearer {key}"}, json=body,
                          timeout=60)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("litellm-routes")
    _keys(d)
    env = {**ENV_FAST, "IBEX_AUTH_KEYS_FILE": str(d / "keys.json"), "IBEX_BROKER_KEY_FILE": str(d / "broker.key"),
           "IBEX_BROKER_PUBLIC_KEY": str(d / "broker.pub"), "IBEX_WORKER_KEY_FILE": str(d / "worker.key")}
    ops = auth.curve_client(auth.load_keypair(d / "acme-proxy.key"), auth.load_public_key(str(d / "broker.pub")))
    stack = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=env, status_socket=ops)
    try:
        hook = {"endpoints": [stack.frontend], "broker_public_key": str(d / "broker.pub"), "timeout_ms": 3000,
                "orgs": {"acme": {"key_file": str(d / "acme-proxy.key")},
                         "globex": {"key_file": str(d / "globex-proxy.key")}}}
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
