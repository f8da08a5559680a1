"""The keys file: which client keys act for which org and agents, and which worker keys may join
(docs/security.md "Authentication"). One public key has one role; every mistake is an
``AuthConfigError`` naming the entry, found when the broker starts or a key is registered.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from ..stores.keys import is_ident
from ..wire.errors import Forbidden, Unauthenticated
from ..wire.protocol import Envelope
from .curve import (
    BACK_DOMAIN,
    FRONT_DOMAIN,
    IDENT_HELP,
    ROLES,
    AuthConfigError,
    check_key_name,
    check_z85,
    os_reason,
)


@dataclass(frozen=True, slots=True)
class ClientGrant:
    name: str
    org_id: str
    agents: frozenset[str]  # {"*"} = every agent of the org

    def allows(self, agent_id: str) -> bool:
        return "*" in self.agents or agent_id in self.agents


def _read_keys_doc(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AuthConfigError(f"cannot read keys file {path}: {exc}") from exc


def _entries(doc: dict[str, Any], section: str, where: str) -> list[Any]:
    entries = doc.get(section, [])
    if not isinstance(entries, list):
        raise AuthConfigError(f"keys file {where}: {section} must be a list")
    return entries


def _entry_key(entry: Any, where: str) -> bytes:
    if not isinstance(entry, dict):
        raise AuthConfigError(f"{where}: expected an object with public_key")
    value = entry.get("public_key")
    if not isinstance(value, str):
        raise AuthConfigError(f"{where}: public_key is missing or not a string")
    key = value.encode()
    check_z85(key, where)
    return key


def _client_grant(entry: dict[str, Any], index: int, where: str) -> ClientGrant:
    org_id, name = entry.get("org_id"), entry.get("name", f"client-{index}")
    if not is_ident(org_id):
        raise AuthConfigError(f"{where}: org_id must be an org id ({IDENT_HELP})")
    agents = entry.get("agents", ["*"])
    if (not isinstance(agents, list) or not agents
            or not all(isinstance(a, str) and (a == "*" or is_ident(a)) for a in agents)):
        raise AuthConfigError(f"{where}: agents must be a non-empty list of agent ids or \"*\"")
    if not isinstance(name, str):
        raise AuthConfigError(f"{where}: name must be a string")
    return ClientGrant(name, org_id, frozenset(agents))


@dataclass(frozen=True, slots=True)
class _Claim:
    """Where a public key was first listed: one role per key (docs/security.md "Authentication")."""

    role: str
    label: str
    grant: ClientGrant | None


def _claim(seen: dict[bytes, _Claim], key: bytes, claim: _Claim, where: str) -> None:
    """Refuse a key listed in two roles, or twice in one role with different grants.

    A key in both lists would let a caller holding only its client key join the backend and
    receive (and answer) every org's requests.
    """
    first = seen.setdefault(key, claim)
    if first is claim:
        return
    if first.role != claim.role:
        raise AuthConfigError(f"keys file {where}: {first.label} and {claim.label} are the same public key; "
                              "a key has one role (client or worker), give each its own keypair")
    if first.grant != claim.grant:
        raise AuthConfigError(f"keys file {where}: {first.label} and {claim.label} list the same public key "
                              "with different grants; keep one entry")


class KeyRing:
    """The keys file, loaded once: client key -> grant, and the set of worker keys."""

    def __init__(self, clients: dict[bytes, ClientGrant], workers: set[bytes]) -> None:
        if clients.keys() & workers:
            raise AuthConfigError("a public key is both a client and a worker key; a key has one role")
        self.clients = clients
        self.workers = workers

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        return cls.from_doc(_read_keys_doc(path), str(path))

    @classmethod
    def from_doc(cls, doc: Any, where: str) -> KeyRing:
        """Check a parsed keys file; every mistake is an AuthConfigError naming the entry."""
        if not isinstance(doc, dict):
            raise AuthConfigError(f"keys file {where}: expected an object with clients and workers")
        seen: dict[bytes, _Claim] = {}
        clients: dict[bytes, ClientGrant] = {}
        for i, c in enumerate(_entries(doc, "clients", where)):
            key = _entry_key(c, f"{where}: clients[{i}]")
            grant = _client_grant(c, i, f"{where}: clients[{i}]")
            _claim(seen, key, _Claim("client", f"clients[{i}] ({grant.name!r})", grant), where)
            clients[key] = grant
        workers: set[bytes] = set()
        for i, w in enumerate(_entries(doc, "workers", where)):
            key = _entry_key(w, f"{where}: workers[{i}]")
            name = w.get("name", f"worker-{i}")
            _claim(seen, key, _Claim("worker", f"workers[{i}] ({name!r})", None), where)
            workers.add(key)
        return cls(clients, workers)

    # ZAP credentials provider protocol (pyzmq): callback(domain, z85 key) -> bool
    def callback(self, domain: str, key: bytes) -> bool:
        if domain == FRONT_DOMAIN:
            return key in self.clients
        if domain == BACK_DOMAIN:
            return key in self.workers
        return False

    def authorize(self, frame: zmq.Frame, req: Envelope) -> None:
        """Broker hook: the authenticated key must cover the request's org and agent."""
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            user = ""
        grant = self.clients.get(str(user).encode())
        if grant is None:
            raise Unauthenticated("the connection carries no known client key")
        if req.org_id != grant.org_id:
            raise Forbidden(f"credential {grant.name!r} is for org {grant.org_id!r}, not {req.org_id!r}",
                            field="org_id")
        if not grant.allows(req.agent_id):
            raise Forbidden(f"credential {grant.name!r} may not act for agent {req.agent_id!r}", field="agent_id")


def _new_entry(public_key: bytes, role: str, name: str, org_id: str | None,
               agents: list[str] | None) -> dict[str, Any]:
    """The keys-file entry for one key, its fields checked with messages naming the CLI flags."""
    if role not in ROLES:
        raise AuthConfigError("--role must be client or worker")
    check_key_name(name)
    entry: dict[str, Any] = {"name": name, "public_key": public_key.decode()}
    if role == "worker":
        return entry
    if not org_id:
        raise AuthConfigError("a client key needs --org")
    if not is_ident(org_id):
        raise AuthConfigError(f"--org {org_id!r} is not an org id ({IDENT_HELP})")
    bad = [a for a in agents or [] if a != "*" and not is_ident(a)]
    if bad:
        raise AuthConfigError(f"--agents {bad[0]!r} is not an agent id ({IDENT_HELP}) or *")
    entry.update(org_id=org_id, agents=agents or ["*"])
    return entry


def register(keys_file: Path, *, public_key: bytes, role: str, name: str, org_id: str | None = None,
             agents: list[str] | None = None, replace: bool = False) -> bool:
    """Add one key to the keys file; with REPLACE, change the entry of a key already in ROLE.

    A key registered in either role is refused unless REPLACE is set, and a key is never given the
    other role, even with REPLACE (docs/security.md "Authentication"). A keys file the broker would refuse is
    not edited. Returns whether an entry was replaced. The file is rewritten atomically.
    """
    entry = _new_entry(public_key, role, name, org_id, agents)
    where = str(keys_file)
    doc: Any = _read_keys_doc(keys_file) if keys_file.exists() else {"clients": [], "workers": []}
    KeyRing.from_doc(doc, where)
    sections = {r: _entries(doc, f"{r}s", where) for r in ROLES}
    other = "worker" if role == "client" else "client"
    for e in sections[other]:
        if e["public_key"] == entry["public_key"]:
            raise AuthConfigError(f"this public key is already registered as {other} {e.get('name')!r}; "
                                  f"a key has one role, generate another keypair for the {role}")
    mine = sections[role]
    same = [i for i, e in enumerate(mine) if e["public_key"] == entry["public_key"]]
    if same and not replace:
        raise AuthConfigError(f"this public key is already registered as {role} {mine[same[0]].get('name')!r}; "
                              "pass --replace to change its entry")
    doc[f"{role}s"] = [e for i, e in enumerate(mine) if i not in same[1:]]
    if same:
        doc[f"{role}s"][same[0]] = entry
    else:
        doc[f"{role}s"].append(entry)
    KeyRing.from_doc(doc, where)
    _write_atomic(keys_file, json.dumps(doc, indent=2) + "\n")
    return bool(same)


def _write_atomic(path: Path, text: str) -> None:
    """Write a sibling temporary file, then rename it over PATH: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise AuthConfigError(f"cannot write keys file {path}: {os_reason(exc)}") from exc
