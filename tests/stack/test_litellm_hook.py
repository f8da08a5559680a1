"""The LiteLLM hook's pure parts: config, identity mapping, model names, the pass-through setting.

The proxy itself is exercised end to end in tests/stack/test_litellm_proxy.py; here the hook is called
directly with LiteLLM's own ``UserAPIKeyAuth`` where no stack is needed (nothing is assembled).

Here: the checks through running servers; the pure parts are in
tests/unit/test_litellm_hook.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException
from litellm.proxy._types import UserAPIKeyAuth

from tests.unit.test_litellm_hook import BASE, _cfg, _hook  # noqa: F401  (fixtures and helpers the unit half defines)


@pytest.mark.parametrize(("messages", "status", "text"), [
    ([{"role": "user", "content": "w " * 140_000}], 400, "ibex-context CONTEXT_OVERFLOW"),
    ([{"role": "tool", "tool_call_id": "call_9", "content": "x"}, {"role": "user", "content": "q"}], 400,
     "ibex-context INVALID_REQUEST"),
])
async def test_caller_faults_are_refused_even_when_the_service_is_down(messages: list[Any], status: int,
                                                                       text: str) -> None:
    """``assemble_or_degrade`` raises caller faults (a degraded prompt would overflow too, a broken
    conversation stays broken): the hook refuses the call with the service's one line."""
    hook = _hook(timeout_ms=100, on_degraded="pass")  # nobody listens on the endpoint: every call degrades
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot"})
    try:
        with pytest.raises(HTTPException) as exc:
            await hook.async_pre_call_hook(key, None, {"model": "gpt-4", "messages": messages}, "acompletion")
        assert exc.value.status_code == status and str(exc.value.detail).startswith(text)
        data: dict[str, Any] = {"model": "gpt-4", "messages": [{"role": "user", "content": "hello"}]}
        out = await hook.async_pre_call_hook(key, None, data, "acompletion")
        got = await hook.async_post_call_response_headers_hook(out, None, None)
        assert got is not None and got["x-ibex-context"] == "degraded" and got["x-ibex-context-directive"] == "absent"
        assert got["x-ibex-context-reason"].startswith("context service ") and out["messages"][-1]["content"] == "hello"
    finally:
        await hook.core.aclose()


@pytest.mark.parametrize(("over", "directive"), [
    ({}, None),  # the default, fallback_directive, with no copy and nothing configured: refused
    ({"on_degraded": "refuse", "fallback_directive": "Be brief."}, None),
    ({"fallback_directive": "Be brief."}, "configured"),
    ({"on_degraded": "pass", "fallback_directive": "Be brief."}, "configured"),
])
async def test_with_the_service_down_each_policy_before_any_copy(over: dict[str, Any], directive: str | None) -> None:
    """Before any assembly has fetched the agent's directive the hook holds no copy of it (the
    proxy test covers the copies): the config's fallback_directive, else a refusal."""
    hook = _hook(timeout_ms=100, **over)
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot"})
    data: dict[str, Any] = {"model": "gpt-4", "messages": [{"role": "user", "content": "hello"}]}
    try:
        if directive is None:
            with pytest.raises(HTTPException) as exc:
                await hook.async_pre_call_hook(key, None, data, "acompletion")
            assert exc.value.status_code == 503 and "could not assemble this call (context service " in str(
                exc.value.detail)
            assert f"on_degraded is {over.get('on_degraded', 'fallback_directive')}" in str(exc.value.detail)
            return
        out = await hook.async_pre_call_hook(key, None, data, "acompletion")
        got = await hook.async_post_call_response_headers_hook(out, None, None)
        assert got is not None and got["x-ibex-context"] == "degraded" and got["x-ibex-context-directive"] == directive
        assert got["x-ibex-context-reason"].endswith("directive: fallback_directive of the ibex-context hook config")
        assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    finally:
        await hook.core.aclose()


def test_the_module_needs_its_config_and_the_client_never_loads_litellm(tmp_path: Path) -> None:
    code = """
import json, sys
import ibex_context.client
before = sorted(m for m in sys.modules if m == "litellm" or m.startswith("litellm."))
import ibex_context.client.integrations.litellm as hook
try:
    hook.proxy_handler
    err = None
except Exception as exc:
    err = f"{type(exc).__name__}: {exc}"
server = sorted(m for m in sys.modules
                if m.startswith(("ibex_context.worker", "ibex_context.memory", "ibex_context.ops")))
print(json.dumps({"before": before, "err": err, "server": server}))
"""
    env = {k: v for k, v in os.environ.items() if k != "IBEX_LITELLM_CONFIG"}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == [] and got["server"] == []
    assert got["err"].startswith("HookConfigError: IBEX_LITELLM_CONFIG is not set")
