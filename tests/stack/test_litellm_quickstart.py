"""docs/litellm.md "Quick start", run as written: its first shell block in bash, from a directory
that holds the repo's ``examples/`` and ``.venv`` (as a fresh clone's root does), with the
shipped ``examples/litellm/`` configs, a real LiteLLM proxy (offline), a local stand-in for both
providers (``bench.litellm_upstream``) reached through the providers' own base-URL variables, and
a stack of its own. Only the port is changed (4000 may be taken on a shared box). Each of the
three assembled routes reaches the upstream with the org's directive."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.litellm_rig import Upstream
from ibex_context.ops.stack import DEMO_DATA, LocalStack, free_port
from tests.helpers import http, start_stack

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_RETRIEVAL_TIMEOUT_MS": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}


def quick_start_block() -> str:
    text = (ROOT / "docs" / "litellm.md").read_text("utf-8")
    start = text.index("## Quick start\n")
    section = text[start: text.index("\n## ", start + 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return str(blocks[0])


def _directive() -> str:
    for line in DEMO_DATA.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "directive" and rec["org_id"] == "acme" and rec["agent_id"] == "support-bot":
            return str(rec["text"])
    raise AssertionError("no demo directive for acme/support-bot")


@dataclass
class Proxy:
    url: str
    key: str
    log: Path
    upstream: Upstream

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        self.upstream.clear()
        return http().post(f"{self.url}{route}", headers={"authorization": f"Bearer {self.key}"}, json=body,
                           timeout=60)

    def sent(self) -> str:
        got = self.upstream.received()
        assert len(got) == 1, got
        return json.dumps(got[0]["body"])


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    work = tmp_path_factory.mktemp("quickstart")
    (work / "examples").symlink_to(ROOT / "examples")
    (work / ".venv").symlink_to(VENV)
    stack: LocalStack = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=ENV_FAST)
    upstream = Upstream(tmp_path_factory.mktemp("upstream"), forked=False)  # no LiteLLM fork parent here
    port = free_port()
    script = quick_start_block().replace("--port 4000", f"--port {port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IBEX_", "LITELLM_", "OPENAI_", "ANTHROPIC_"))}
    env.update({"IBEX_BROKER_ENDPOINTS": stack.frontend, "IBEX_CLIENT_TIMEOUT_MS": "3000",
                "OPENAI_API_KEY": "upstream-key", "OPENAI_BASE_URL": f"{upstream.base}/v1",
                "ANTHROPIC_API_KEY": "upstream-key", "ANTHROPIC_API_BASE": upstream.base,
                "LITELLM_TELEMETRY": "False", "PYTHONUNBUFFERED": "1"})
    log = work / "quickstart.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(["bash", "-eu", "-c", script], cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the quick start exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if http().get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        key = re.search(r"sk-ibex-[A-Za-z0-9_-]{43}", log.read_text())
        assert key is not None, log.read_text()[-3000:]
        yield Proxy(url, key.group(0), log, upstream)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the block's bash and the proxy it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        upstream.stop()
        stack.stop()


def test_chat_completions_is_assembled(proxy: Proxy) -> None:
    resp = proxy.post("/v1/chat/completions", {"model": "gpt-4o", "messages": [
        {"role": "user", "content": "When will my invoice be paid?"}]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "assembled", dict(resp.headers)
    sent = proxy.sent()
    assert json.dumps(_directive())[1:-1] in sent and "<memories nonce=" in sent


def test_v1_messages_is_assembled(proxy: Proxy) -> None:
    resp = proxy.post("/v1/messages", {"model": "claude-sonnet", "max_tokens": 64, "messages": [
        {"role": "user", "content": "When will my invoice be paid?"}]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "assembled", dict(resp.headers)
    assert json.dumps(_directive())[1:-1] in proxy.sent()


def test_v1_responses_is_assembled(proxy: Proxy) -> None:
    resp = proxy.post("/v1/responses", {"model": "gpt-4o", "input": "When will my invoice be paid?"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ibex-context"] == "assembled", dict(resp.headers)
    assert json.dumps(_directive())[1:-1] in proxy.sent()


def test_the_documented_warning_is_the_one_litellm_logs(proxy: Proxy) -> None:
    log = proxy.log.read_text(errors="replace")
    assert "custom_auth is configured but 'custom_auth_run_common_checks' is not set" in log, log[-3000:]
