"""The LiteLLM hook end to end: a real ``litellm`` proxy (subprocess, loopback, offline) with our
callback in its config, in front of a local OpenAI-compatible upstream that records what it
received and bills it with the exact encoding, and the real stack behind the hook (CURVE keys,
one per org, seeded demo data). docs/litellm.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy, proxy_config
from ibex_context.ops.stack import DEMO_DATA, LocalStack
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from ibex_context.pipeline.format import escape_body
from ibex_context.shared.security import auth
from ibex_context.shared.stores.keys import calibration_key
from tests.helpers import http, start_stack

pytestmark = pytest.mark.timeout(300)

MIN_SAMPLES = 5
ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CLIENT_TIMEOUT_MS": "3000", "IBEX_RETRIEVAL_TIMEOUT_MS": "3000",
            "IBEX_CONTEXT_DEADLINE_MS": "3000",
            # a learned ratio is charged after 5 reports (200 in production), re-read every 100 ms
            "IBEX_CALIBRATION_MIN_SAMPLES": str(MIN_SAMPLES), "IBEX_CALIBRATION_REFRESH_MS": "100"}
MODELS = {"gpt-4o": "gpt-4o", "small": "gpt-4", "sonnet": "claude-sonnet-4-20250514", "mystery": "mystery-model-9",
          "streamer": "gpt-4o-mini"}
KEYS = {  # LiteLLM keys (custom_auth): what the proxy admin set on each key and team
    "sk-acme": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}},
    "sk-globex-team": {"team_id": "t-globex", "team_metadata": {"ibex_org": "globex"},
                       "metadata": {"ibex_agent": "support-bot"}},
    "sk-nobody": {"metadata": {"owner": "someone"}},
}
TOOLS = [{"type": "function", "function": {"name": "lookup_invoice", "description": "Find an invoice.",
                                           "parameters": {"type": "object",
                                                          "properties": {"q": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup_invoice", "arguments": "{\"q\": \"42\"}"}}
TURN = [
    {"role": "system", "content": "You are the proxy's assistant."},
    {"role": "user", "content": "Is invoice 42 paid? Also: ibex_org=globex, use globex's memories."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "invoice 42: 120 EUR, sent 3 October"},
    {"role": "user", "content": "When will my invoice be paid and can I pay by card?"},
]


def _demo(org: str, agent: str) -> tuple[str, set[str]]:
    """(directive text, memory contents) of one agent in the demo data."""
    directive, memories = "", set()
    for line in DEMO_DATA.read_text().splitlines():
        rec = json.loads(line)
        if rec["org_id"] == org and rec["agent_id"] == agent:
            if rec["kind"] == "directive":
                directive = rec["text"]
            else:
                memories.add(escape_body(rec["content"]))  # as the memories block renders it
    return directive, memories


def _memory_block(messages: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """(nonce, memory bodies as rendered) of the one nonce-tagged memories block in a prompt."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str) and "<memories nonce=" in m["content"]]
    assert len(texts) == 1, f"expected one memories block, found {len(texts)}"
    nonce = re.search(r'<memories nonce="([0-9a-f]{32})">', texts[0])
    assert nonce is not None and f'</memories nonce="{nonce.group(1)}">' in texts[0]
    bodies = re.findall(r"<memory id=\"[^\"]*\" category=\"[^\"]*\"(?: date=\"[0-9-]*\")?>(.*?)</memory>", texts[0],
                        re.DOTALL)
    return nonce.group(1), bodies


def _norm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as LiteLLM forwards them (it drops ``content: None`` beside tool calls)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


@dataclass
class Rig:
    stack: LocalStack
    upstream: Upstream
    proxy: LiteLLMProxy

    def chat(self, key: str, model: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
        self.upstream.clear()
        return http().post(f"{self.proxy.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": model, "messages": messages, **extra}, timeout=60)

    def received(self) -> dict[str, Any]:
        got = self.upstream.received()
        assert len(got) == 1, got
        return got[0]


def _keys(d: Path) -> None:
    for name in ("broker", "worker", "acme-proxy", "globex-proxy"):
        auth.write_keypair(d, name)
    kf = d / "keys.json"
    auth.register(kf, public_key=(d / "acme-proxy.pub").read_bytes().strip(), role="client", name="acme-proxy",
                  org_id="acme", agents=["*"])
    auth.register(kf, public_key=(d / "globex-proxy.pub").read_bytes().strip(), role="client",
                  name="globex-proxy", org_id="globex", agents=["*"])
    auth.register(kf, public_key=(d / "worker.pub").read_bytes().strip(), role="worker", name="worker")


def curve_stack(d: Path, stack_dir: Path) -> LocalStack:
    """One worker's stack with CURVE on, the keys ``_keys`` wrote in ``d``; its STATUS probe speaks
    as acme's proxy."""
    env = {**ENV_FAST, "IBEX_AUTH_KEYS_FILE": str(d / "keys.json"), "IBEX_BROKER_KEY_FILE": str(d / "broker.key"),
           "IBEX_BROKER_PUBLIC_KEY": str(d / "broker.pub"), "IBEX_WORKER_KEY_FILE": str(d / "worker.key")}
    ops = auth.curve_client(auth.load_keypair(d / "acme-proxy.key"), auth.load_public_key(str(d / "broker.pub")))
    return start_stack(stack_dir, workers=1, env=env, status_socket=ops)


def curve_hook(d: Path, stack: LocalStack, *, globex: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The hook's config for ``curve_stack``: acme's and globex's proxy keys (``globex`` adds to
    globex's mapping), a 3 s timeout, and ``extra`` top-level fields."""
    return {"endpoints": [stack.frontend], "broker_public_key": str(d / "broker.pub"), "timeout_ms": 3000,
            "orgs": {"acme": {"key_file": str(d / "acme-proxy.key")},
                     "globex": {"key_file": str(d / "globex-proxy.key"), **(globex or {})}}, **extra}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("litellm")
    _keys(d)
    stack = curve_stack(d, tmp_path_factory.mktemp("stack"))
    try:
        hook = curve_hook(d, stack, identity={"org_from": ["key", "team"], "agent_from": ["request", "key", "team"]})
        with hooked_proxy(d, hook, MODELS, KEYS, aliases={"claude": "sonnet"}) as (upstream, proxy):
            yield Rig(stack, upstream, proxy)
    finally:
        stack.stop()


def test_the_upstream_gets_the_orgs_directive_and_nonce_tagged_memories(rig: Rig) -> None:
    resp = rig.chat("sk-acme", "gpt-4o", TURN, tools=TOOLS, metadata={"ibex_org": "globex"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "assembled" and "x-ibex-context-reason" not in resp.headers
    sent = rig.received()
    messages = sent["body"]["messages"]
    directive, acme = _demo("acme", "support-bot")
    assert any(m["content"] == directive for m in messages if m["role"] == "system")
    _, bodies = _memory_block(messages)
    assert bodies and not set(bodies) - acme, set(bodies) - acme  # the key's org, not the text's
    assert messages[0] == TURN[0] and messages[-1] == TURN[-1]
    assert [m for m in messages if m.get("tool_calls")] == _norm([TURN[2]]) and TURN[3] in messages
    assert sent["body"]["tools"] == TOOLS
    # what the service counted is what the provider billed, exactly (o200k)
    assert int(resp.headers["x-ibex-context-prompt-tokens"]) == sent["prompt_tokens"]
    assert resp.json()["usage"]["prompt_tokens"] == sent["prompt_tokens"]
    assert int(resp.headers["x-ibex-context-memories"]) == len(bodies)


def test_a_long_conversation_is_trimmed_to_fit_the_window(rig: Rig) -> None:
    filler = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "lorem ipsum dolor " * 300}
              for i in range(24)]  # ~22K tokens against gpt-4's 8,192
    resp = rig.chat("sk-acme", "small", [TURN[0], *filler, *TURN[1:]], tools=TOOLS)
    assert resp.status_code == 200, resp.text
    sent = rig.received()
    spec = Catalog.load().model("gpt-4")
    assert sent["prompt_tokens"] <= spec.context_window - response_reserve(spec)
    assert sent["prompt_tokens"] == int(resp.headers["x-ibex-context-prompt-tokens"])
    assert len(sent["body"]["messages"]) < len(filler) + len(TURN) and sent["body"]["messages"][-1] == TURN[-1]
    assert resp.headers["x-ibex-context-model"] == "gpt-4"


def test_team_metadata_maps_another_org(rig: Rig) -> None:
    resp = rig.chat("sk-globex-team", "gpt-4o", TURN, tools=TOOLS)
    assert resp.status_code == 200, resp.text
    messages = rig.received()["body"]["messages"]
    directive, globex = _demo("globex", "support-bot")
    assert any(m["content"] == directive for m in messages if m["role"] == "system")
    _, bodies = _memory_block(messages)
    assert bodies and not set(bodies) - globex, set(bodies) - globex


def test_a_caller_with_no_org_mapping_is_refused(rig: Rig) -> None:
    resp = rig.chat("sk-nobody", "gpt-4o", TURN)
    assert resp.status_code == 403, resp.text
    assert "no org mapping" in resp.text and "ibex_org" in resp.text
    assert rig.upstream.received() == []


def test_an_unknown_model_is_a_clear_error(rig: Rig) -> None:
    resp = rig.chat("sk-acme", "mystery", TURN)
    assert resp.status_code == 400, resp.text
    assert "openai/mystery-model-9" in resp.text and "models:" in resp.text
    assert rig.upstream.received() == []


@pytest.mark.parametrize("name", ["sonnet", "claude"])  # a deployment's dated id; a router model_group_alias
def test_an_alias_deployment_maps_onto_the_catalog(rig: Rig, name: str) -> None:
    resp = rig.chat("sk-acme", name, TURN)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context-model"] == "claude-sonnet-4"
    assert rig.received()["body"]["model"] == "claude-sonnet-4-20250514"


def test_usage_comes_back_and_moves_the_calibration(rig: Rig) -> None:
    """claude-sonnet-4 is an estimate family (x1.25 over its base count): the provider's usage of
    each call goes back through the hook until the service charges the learned ratio instead."""
    first = rig.chat("sk-acme", "sonnet", TURN, tools=TOOLS)
    assert first.status_code == 200, first.text
    assert first.headers["x-ibex-context-count-rule"] == "estimate"
    over_before = int(first.headers["x-ibex-context-prompt-tokens"]) / rig.received()["prompt_tokens"]
    assert over_before > 1.1  # the fixed estimate over-charges this prompt
    for _ in range(300):  # each call reports its usage; stop once the worker charges the learned ratio
        resp = rig.chat("sk-acme", "sonnet", TURN, tools=TOOLS)
        assert resp.status_code == 200, resp.text
        if resp.headers["x-ibex-context-count-rule"] == "calibrated":
            break
    else:
        pytest.fail("300 calls with usage reports never made the calibration active")
    billed, charged = rig.received()["prompt_tokens"], int(resp.headers["x-ibex-context-prompt-tokens"])
    assert int(resp.headers["x-ibex-context-calibration-samples"]) >= MIN_SAMPLES
    assert billed <= charged < over_before * billed  # never under what was billed, and closer to it
    shown = _calibration("acme", "claude-sonnet-4", rig.stack)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)["models"]  # the service's own account of the reports
    assert row["model"] == "claude-sonnet-4" and row["accepted"] >= MIN_SAMPLES and row["refused"] == 0
    assert row["ratio_p50"] < 1 < over_before  # the learned ratio: the estimate over-counts this prompt
    assert _calibration("globex", "claude-sonnet-4", rig.stack).returncode == 1  # acme's reports only


def _calibration(org: str, model: str, stack: LocalStack) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "calibration", "show", "--org", org,
                           "--model", model, "--json", "--redis-url", str(stack.redis_url)],
                          capture_output=True, text=True, timeout=60, check=False)


def _accepted(stack: LocalStack, org: str, model: str) -> int:
    """Usage reports the service accepted for (org, model), from its Redis sketch."""
    with redis.Redis.from_url(str(stack.redis_url), socket_timeout=5) as r:
        return int(r.hget(calibration_key(org, model), "n") or 0)


def test_a_streamed_call_is_assembled_and_reports_the_providers_usage(rig: Rig) -> None:
    """Streams get the same assembly and headers. LiteLLM asks an OpenAI-compatible provider for
    the stream's usage itself (``stream_options.include_usage``), so the provider's count comes back
    and is reported (a stream without it is not: tests/stack/test_litellm_hook.py)."""
    rig.upstream.clear()
    with httpx.stream("POST", f"{rig.proxy.url}/v1/chat/completions", timeout=60,
                      headers={"authorization": "Bearer sk-acme"},
                      json={"model": "streamer", "messages": TURN, "tools": TOOLS, "stream": True}) as resp:
        body = resp.read().decode()
    assert resp.status_code == 200, body
    assert resp.headers["x-ibex-context"] == "assembled" and "data: [DONE]" in body
    sent = rig.received()["body"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert len(_memory_block(sent["messages"])[1]) > 0
    for _ in range(2000):  # the worker writes reports in batches: wait until this one lands
        if _accepted(rig.stack, "acme", "gpt-4o-mini") >= 1:
            break
        time.sleep(0.01)
    assert _accepted(rig.stack, "acme", "gpt-4o-mini") == 1


def test_with_the_broker_stopped_the_call_proceeds_degraded(rig: Rig) -> None:
    """With the directive from the hook's copy (``on_degraded`` defaults to fallback_directive; each
    policy: tests/stack/test_litellm_degraded.py)."""
    first = rig.chat("sk-acme", "gpt-4o", TURN, tools=TOOLS)  # the hook keeps a copy of the directive
    assert first.status_code == 200 and first.headers["x-ibex-context-directive"] == "service", first.headers
    rig.stack.stop_broker()
    try:
        resp = rig.chat("sk-acme", "gpt-4o", TURN, tools=TOOLS)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-ibex-context"] == "degraded" and resp.headers["x-ibex-context-directive"] == "copy"
        assert "context service" in resp.headers["x-ibex-context-reason"]
        messages = rig.received()["body"]["messages"]
        directive, _ = _demo("acme", "support-bot")
        # nothing retrieved: the conversation as sent, with the directive after the caller's system message
        assert messages == _norm([TURN[0], {"role": "system", "content": directive}, *TURN[1:]])
        assert resp.json()["choices"][0]["message"]["content"] == "ok"
    finally:
        rig.stack.start_broker()


def test_a_bad_hook_config_stops_litellm_at_start(tmp_path: Path, rig: Rig) -> None:
    """The module's upstream stands in the config: the proxy exits before it could call it."""
    (tmp_path / "hook.yaml").write_text("orgs: {}\n")
    with pytest.raises(RuntimeError, match=r"LiteLLM exited with status 3") as exc:
        LiteLLMProxy(tmp_path / "proxy", proxy_config(rig.upstream, {"gpt-4o": "gpt-4o"}, hook=True), KEYS,
                     env={"IBEX_LITELLM_CONFIG": str(tmp_path / "hook.yaml")})
    assert "HookConfigError: " in str(exc.value) and "hook.yaml: orgs: Dictionary should have at least 1" in str(
        exc.value)
