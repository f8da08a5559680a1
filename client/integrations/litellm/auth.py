"""A LiteLLM ``custom_auth``: bearer keys mapped to key and team metadata from a file, so the hook
can read each caller's ``ibex_org`` and ``ibex_agent`` without LiteLLM's database (docs/litellm.md "Using it
from LiteLLM proxy")::

    general_settings:
      custom_auth: ibex_context.client.integrations.litellm.auth.user_api_key_auth

``IBEX_LITELLM_KEYS`` names the keys file (``.json``, else YAML)::

    keys:
      - name: acme-support                  # unique; LiteLLM's key alias in its logs
        sha256: <64 hex digits>             # SHA-256 of the bearer key (LiteLLM's own key hash)
        metadata: {ibex_org: acme, ibex_agent: support-bot}
        team_id: t-acme                     # optional, with team_metadata

The file holds hashes only, never a key. A call's key is hashed and compared with every entry's
hash in constant time (``hmac.compare_digest``, every entry, no early exit). There are no default
keys: a missing, empty or invalid file stops the proxy at start, naming the field. With a
``custom_auth``, LiteLLM's own key check (its master key included) is not consulted.

    python -m ibex_context.client.integrations.litellm.auth add --file keys.yaml --name acme-support \\
        --org acme --agent support-bot     # makes a key, adds its hash, prints the key once
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from ....shared.config.settings import ClientSettings
from ....shared.stores.keys import is_ident
from .config import HookConfigError

KEYS_ENV = "IBEX_LITELLM_KEYS"
KEY_PREFIX = "sk-ibex-"

__all__ = ["KeyEntry", "KeysFile", "authenticate", "key_hash", "load_keys"]  # and user_api_key_auth (__getattr__)


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@-]{1,128}$")]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    metadata: dict[str, Any] = Field(default_factory=dict)
    team_id: str | None = None
    team_metadata: dict[str, Any] = Field(default_factory=dict)


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: Annotated[list[KeyEntry], Field(min_length=1)]

    @field_validator("keys")
    @classmethod
    def _unique(cls, v: list[KeyEntry]) -> list[KeyEntry]:
        for attr in ("name", "sha256"):
            seen: set[str] = set()
            for entry in v:
                value = getattr(entry, attr)
                if value in seen:
                    raise ValueError(f"two keys with the same {attr}: {value if attr == 'name' else value[:8]}…")
                seen.add(value)
        return v


def key_hash(key: str) -> str:
    """SHA-256 hex of a bearer key: what the file keeps, and LiteLLM's own hash of a key."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _read(path: Path) -> Any:
    text = path.read_text("utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    import yaml  # comes with litellm[proxy]

    return yaml.safe_load(text)


def load_keys(path: str | Path) -> KeysFile:
    """The keys file; ``HookConfigError`` naming the file and the first bad field."""
    try:
        doc = _read(Path(path))
    except OSError as exc:
        raise HookConfigError(f"{KEYS_ENV}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HookConfigError(f"{KEYS_ENV}: {path} is not valid: {exc}") from None
    try:
        return KeysFile.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        raise HookConfigError(f"{KEYS_ENV}: {path}: {loc}: {err['msg']}") from None


def authenticate(keys: KeysFile, api_key: object) -> KeyEntry | None:
    """The entry whose hash is the key's, compared with every entry in constant time, or None."""
    if not isinstance(api_key, str) or not api_key:
        return None
    digest = key_hash(api_key).encode()
    found: KeyEntry | None = None
    for entry in keys.keys:  # no early exit: the time does not depend on which entry matches
        if hmac.compare_digest(digest, entry.sha256.encode()):
            found = entry
    return found


def make_auth(keys: KeysFile) -> Callable[[Any, str], Awaitable[Any]]:
    """``custom_auth(request, api_key)`` over ``keys``: the key's entry as a ``UserAPIKeyAuth``."""
    from fastapi import HTTPException
    from litellm.proxy._types import UserAPIKeyAuth

    async def user_api_key_auth(request: Any, api_key: str) -> Any:
        entry = authenticate(keys, api_key)
        if entry is None:  # an HTTPException: LiteLLM answers it as is (401), any other error is a 500
            raise HTTPException(status_code=401, detail=f"ibex-context: unknown key (not in {KEYS_ENV})")
        return UserAPIKeyAuth(api_key=api_key, key_alias=entry.name, metadata=dict(entry.metadata),
                              team_id=entry.team_id, team_metadata=dict(entry.team_metadata))

    return user_api_key_auth


_auth: Callable[[Any, str], Awaitable[Any]] | None = None


def __getattr__(name: str) -> Any:
    """``user_api_key_auth``: ``make_auth`` over the file named by ``IBEX_LITELLM_KEYS``, read once
    when LiteLLM loads its config (a bad file stops the proxy at start)."""
    global _auth
    if name != "user_api_key_auth":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _auth is None:
        path = ClientSettings().litellm_keys
        if not path:
            raise HookConfigError(f"{KEYS_ENV} is not set: point it at the proxy's keys file "
                                  "(docs/litellm.md)")
        _auth = make_auth(load_keys(path))
    return _auth


def add_key(path: Path, name: str, org: str, agent: str | None) -> str:
    """Make a key, add its hash to the file at ``path`` (made if missing) and return the key."""
    if not is_ident(org) or (agent is not None and not is_ident(agent)):
        raise HookConfigError("--org and --agent must match [A-Za-z0-9_.-]{1,64}")
    doc = _read(path) if path.exists() else {"keys": []}
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    metadata = {"ibex_org": org, **({"ibex_agent": agent} if agent else {})}
    entries = [*(doc or {}).get("keys", []), {"name": name, "sha256": key_hash(key), "metadata": metadata}]
    try:
        checked = KeysFile.model_validate({**(doc or {}), "keys": entries})
    except ValidationError as exc:
        raise HookConfigError(f"{path}: {exc.errors()[0]['msg']}") from None
    out = checked.model_dump(mode="json", exclude_defaults=True)
    if path.suffix == ".json":
        text = json.dumps(out, indent=2) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(out, sort_keys=False)
    path.write_text(text, "utf-8")
    path.chmod(0o600)
    return key


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ibex_context.client.integrations.litellm.auth",
                                 description="Keys for the LiteLLM proxy's custom_auth (hashes only on disk).")
    sub = ap.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="make a key, add its hash to the keys file, print the key once")
    add.add_argument("--file", required=True, type=Path)
    add.add_argument("--name", required=True)
    add.add_argument("--org", required=True)
    add.add_argument("--agent")
    args = ap.parse_args(argv)
    try:
        key = add_key(args.file, args.name, args.org, args.agent)
    except (HookConfigError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
