"""The LiteLLM ``custom_auth`` shipped with the hook (client/integrations/litellm/auth.py): bearer
keys mapped to key and team metadata from a keys file, hashes only, no database, no default keys.
docs/litellm.md. Every other LiteLLM proxy test authenticates through it too
(bench.litellm_rig writes its keys file).

Here: the checks through running servers; the pure parts are in
tests/unit/test_litellm_auth.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.litellm_rig import MASTER_KEY, LiteLLMProxy, Upstream, proxy_config
from ibex_context.client.integrations.litellm import auth as litellm_auth
from ibex_context.client.integrations.litellm.auth import KEYS_ENV, authenticate, key_hash, load_keys, main
from ibex_context.client.integrations.litellm.config import HookConfigError
from tests.helpers import http, main_in_process
from tests.unit.test_litellm_auth import _write

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ibex_context.client.integrations.litellm.auth"]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    """One upstream for the module's proxies: each test clears what it received before it looks."""
    up = Upstream(tmp_path_factory.mktemp("upstream"))
    try:
        yield up
    finally:
        up.stop()


def test_no_keys_file_no_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module as a fresh import leaves it (no ``user_api_key_auth`` built yet), without a keys file."""
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.setattr(litellm_auth, "_auth", None)
    with pytest.raises(HookConfigError) as exc:
        litellm_auth.user_api_key_auth  # noqa: B018  (the module's __getattr__ builds it on first access)
    assert f"{type(exc.value).__name__}: {exc.value}".startswith(f"HookConfigError: {KEYS_ENV} is not set")


def test_the_cli_adds_a_hash_and_prints_the_key_once(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    keys = []
    out = subprocess.run([*CLI, "add", "--file", str(path), "--name", "acme-support", "--org", "acme",
                          "--agent", "bot"], capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert out.returncode == 0, out.stderr
    keys.append(out.stdout.strip())
    out = main_in_process(main, "add", "--file", str(path), "--name", "globex-support", "--org", "globex",
                          "--agent", "bot", env=dict(os.environ))  # its main() again, without a second interpreter
    assert out.returncode == 0, out.stderr
    keys.append(out.stdout.strip())
    loaded = load_keys(path)
    assert [e.name for e in loaded.keys] == ["acme-support", "globex-support"]
    assert [authenticate(loaded, k).metadata for k in keys] == [  # type: ignore[union-attr]
        {"ibex_org": "acme", "ibex_agent": "bot"}, {"ibex_org": "globex", "ibex_agent": "bot"}]
    text = path.read_text()
    assert all(k.startswith("sk-ibex-") and len(k) > 40 and k not in text for k in keys)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = main_in_process(main, "add", "--file", str(path), "--name", "acme-support", "--org", "acme",
                            env=dict(os.environ))
    assert again.returncode == 2 and "two keys with the same name" in again.stderr
    assert load_keys(path) == loaded  # unchanged


def test_a_real_proxy_takes_the_files_keys_and_nothing_else(tmp_path: Path, upstream: Upstream) -> None:
    """No database: a key made by the CLI (its main(): the test above runs the real command) calls
    the model; an unknown key, no key and LiteLLM's master key are 401, on a model route and on a
    route that never reaches a model."""
    path = tmp_path / "keys.yaml"
    out = main_in_process(main, "add", "--file", str(path), "--name", "acme", "--org", "acme", "--agent", "bot",
                          env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    proxy = LiteLLMProxy(tmp_path / "proxy", proxy_config(upstream, {"gpt-4o": "gpt-4o"}, hook=False),
                         {"sk-unused": {}}, env={KEYS_ENV: str(path)})
    try:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        upstream.clear()
        ok = http().post(f"{proxy.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                         json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        upstream.clear()
        for headers in ({"authorization": "Bearer sk-unused"}, {"authorization": f"Bearer {MASTER_KEY}"}, {},
                        {"authorization": f"Bearer {key_hash(key)}"}):
            for method, route in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                resp = http().request(method, f"{proxy.url}{route}", headers=headers, json=body, timeout=60)
                assert resp.status_code == 401, (headers, route, resp.text)
        assert upstream.received() == []
    finally:
        proxy.stop()


def test_a_bad_keys_file_stops_litellm_at_start(tmp_path: Path, upstream: Upstream) -> None:
    bad = _write(tmp_path / "keys.json", {"keys": []})
    with pytest.raises(RuntimeError, match=r"LiteLLM exited with status") as exc:
        LiteLLMProxy(tmp_path / "proxy", proxy_config(upstream, {"gpt-4o": "gpt-4o"}, hook=False),
                     {"sk-unused": {}}, env={KEYS_ENV: str(bad)})
    assert f"HookConfigError: {KEYS_ENV}: {bad}: keys: List should have at least 1 item" in str(exc.value)
