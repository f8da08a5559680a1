"""The LiteLLM ``custom_auth`` shipped with the hook (client/integrations/litellm/auth.py): bearer
keys mapped to key and team metadata from a keys file, hashes only, no database, no default keys.
docs/litellm.md. Every other LiteLLM proxy test authenticates through it too
(bench.litellm_rig writes its keys file).

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_litellm_auth.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ibex_context.client.integrations.litellm import auth as litellm_auth
from ibex_context.client.integrations.litellm.auth import KEYS_ENV, authenticate, key_hash, load_keys, make_auth
from ibex_context.client.integrations.litellm.config import HookConfigError

pytestmark = pytest.mark.timeout(300)


def _write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _entry(name: str, key: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "sha256": key_hash(key), **extra}


@pytest.mark.parametrize(("doc", "message"), [
    ({"keys": []}, "keys: List should have at least 1 item"),
    ({}, "keys: Field required"),
    (None, "<root>: Input should be a valid dictionary"),
    ({"keys": [{"name": "a", "sha256": "abc"}]}, "keys.0.sha256: String should match pattern"),
    ({"keys": [{"name": "a", "key": "sk-plain", "sha256": key_hash("k")}]}, "keys.0.key: Extra inputs"),
    ({"keys": [_entry("a", "k1"), _entry("a", "k2")]}, "two keys with the same name: a"),
    ({"keys": [_entry("a", "k1"), _entry("b", "k1")]}, "two keys with the same sha256"),
])
def test_a_bad_keys_file_is_one_line_naming_the_field(tmp_path: Path, doc: Any, message: str) -> None:
    with pytest.raises(HookConfigError, match=message.replace(".", r"\.")) as exc:
        load_keys(_write(tmp_path / "keys.json", doc))
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"{KEYS_ENV}: ")


def test_yaml_keys_and_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text(f"keys:\n  - name: acme\n    sha256: {key_hash('sk-1')}\n"
                                        "    metadata: {ibex_org: acme}\n")
    assert load_keys(tmp_path / "keys.yaml").keys[0].metadata == {"ibex_org": "acme"}
    with pytest.raises(HookConfigError, match="cannot read"):
        load_keys(tmp_path / "missing.yaml")


def test_a_key_matches_its_own_entry_only() -> None:
    keys = litellm_auth.KeysFile.model_validate({"keys": [_entry("a", "sk-a"), _entry("b", "sk-b")]})
    assert authenticate(keys, "sk-a").name == "a" and authenticate(keys, "sk-b").name == "b"  # type: ignore[union-attr]
    for wrong in ("sk-c", "", "sk-a ", key_hash("sk-a"), None, 42):
        assert authenticate(keys, wrong) is None  # the hash itself is no key either


async def test_the_auth_gives_litellm_the_entrys_metadata() -> None:
    keys = litellm_auth.KeysFile.model_validate({"keys": [
        _entry("globex-bot", "sk-g", metadata={"ibex_agent": "bot"}, team_id="t-g",
               team_metadata={"ibex_org": "globex"})]})
    auth = make_auth(keys)
    got = await auth(None, "sk-g")
    assert (got.key_alias, got.metadata, got.team_id, got.team_metadata) == (
        "globex-bot", {"ibex_agent": "bot"}, "t-g", {"ibex_org": "globex"})
    assert got.api_key == key_hash("sk-g")  # LiteLLM keeps the key's hash, never the key
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as exc:
        await auth(None, "sk-nope")
    assert exc.value.status_code == 401
