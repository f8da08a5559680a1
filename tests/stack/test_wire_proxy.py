"""A new user's first large calls through the real ``openai`` SDK and a real LiteLLM proxy with the
hook, in front of a recording upstream, the real stack behind it (docs/assembly.md "Size limits").

Calls a smaller size limit would refuse (``400 ... request payload is N bytes, over the
limit``): 200 turns of 1,500 words on an 8K model, a 5 MB conversation on gpt-4.1, a 1000x800
screenshot as a 3.2 MB data URL. Each is assembled, trimmed to fit, and what reaches the upstream
is the caller's own parts, the screenshot byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.litellm_rig import LiteLLMProxy, Upstream, hooked_proxy
from bench.wire_size import cases
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(600)

CASES = cases()
MODELS = {"gpt-4.1": "gpt-4.1", "small": "gpt-4"}
KEYS = {"sk-acme": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}}}
ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
       "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Upstream, LiteLLMProxy]]:
    stack = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=ENV)  # plaintext, loopback
    try:
        hook = {"endpoints": [stack.frontend], "timeout_ms": 30_000, "orgs": {"acme": {}}}
        with hooked_proxy(Path(tmp_path_factory.mktemp("proxy")), hook, MODELS, KEYS) as (upstream, proxy):
            yield stack, upstream, proxy
    finally:
        stack.stop()


def _send(rig: tuple[LocalStack, Upstream, LiteLLMProxy], model: str, messages: list[dict[str, Any]]
          ) -> tuple[dict[str, str], dict[str, Any]]:
    """(the proxy's response headers, what the upstream received) for one chat completion."""
    _, upstream, proxy = rig
    upstream.clear()
    with openai.OpenAI(api_key="sk-acme", base_url=f"{proxy.url}/v1", max_retries=0, timeout=300) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(model=model, messages=messages)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == "ok"
    (got,) = upstream.received()
    return dict(raw.headers), got


@pytest.mark.parametrize(("case", "model"), [("200 turns x 1,500 words, gpt-4 (8K)", "small"),
                                             ("300 turns, 5 MB, gpt-4.1 (1M)", "gpt-4.1")])
def test_a_long_conversation_is_assembled_and_trimmed_to_fit(rig: Any, case: str, model: str) -> None:
    messages = CASES[case]["messages"]
    headers, got = _send(rig, model, messages)
    assert headers["x-ibex-context"] == "assembled", headers.get("x-ibex-context-reason")
    spec = Catalog.load().model(MODELS[model])
    sent = got["body"]["messages"]
    assert got["prompt_tokens"] == int(headers["x-ibex-context-prompt-tokens"])  # counted as billed
    assert got["prompt_tokens"] <= spec.context_window - response_reserve(spec)
    kept = [m for m in sent if m in messages]
    assert sent[-1] == messages[-1] and 1 < len(kept) < len(messages)  # trimmed, the latest turn kept
    assert kept == [m for m in messages if m in kept]  # in order, as sent


def test_a_screenshot_reaches_the_upstream_byte_for_byte_and_is_billed_as_counted(rig: Any) -> None:
    messages = CASES["1000x800 PNG data URL, gpt-4.1"]["messages"]
    headers, got = _send(rig, "gpt-4.1", messages)
    assert headers["x-ibex-context"] == "assembled", headers.get("x-ibex-context-reason")
    assert got["body"]["messages"][-1] == messages[-1]  # the 3.2 MB data URL unchanged
    assert got["prompt_tokens"] == int(headers["x-ibex-context-prompt-tokens"])  # the image counted by its size
