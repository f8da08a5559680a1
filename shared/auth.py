"""Caller authentication: ZeroMQ CURVE encryption + ZAP, keys mapped to orgs (closes the spec's
"non-loopback use trusts caller-supplied org_id and agent_id" known limit).

* Every caller (proxy) and every worker has a CURVE keypair. The broker has one too.
* A keys file (JSON) maps each client public key to its org and allowed agents, and lists the
  worker public keys allowed to join:

      {"clients": [{"name": "proxy-1", "public_key": "<z85>", "org_id": "acme", "agents": ["*"]}],
       "workers": [{"name": "host-a", "public_key": "<z85>"}]}

* The broker runs a ZAP handler (pyzmq's ThreadAuthenticator) that admits only listed keys, per
  domain (frontend: clients, backend: workers). Each admitted frame carries its key as
  ``User-Id``; the broker looks the org up from that key and answers FORBIDDEN when the payload's
  org_id or agent_id is not covered. The org in the payload is never trusted on its own.
* One public key has one role: a keys file listing a key as both client and worker (or twice in
  one role with different grants) is refused, so a caller's key can never join the backend.
* Without a keys file, binding anything but loopback or ipc is refused at start-up. The check is
  ``shared.netloc.is_local_endpoint`` (strict: no ``;`` source-address form, IP literals or
  ``localhost`` only), because ZeroMQ binds the part after ``;`` and resolves names at bind time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from ibex_context.shared.codec import Envelope
from ibex_context.shared.errors import Forbidden, Unauthenticated
from ibex_context.shared.models import IDENT_CHARS
from ibex_context.shared.netloc import is_local_endpoint
from ibex_context.shared.settings import Settings

FRONT_DOMAIN = "ibex-front"
BACK_DOMAIN = "ibex-back"
ROLES = ("client", "worker")
# Org and agent ids in grants, and key names (they become NAME.key / NAME.pub): the identifier
# alphabet of the wire envelope, so a name is never a path and never a hidden file.
_IDENT = re.compile(IDENT_CHARS)
_IDENT_HELP = "1-64 characters of A-Z a-z 0-9 _ . -"


class AuthConfigError(Exception):
    """A keys file or key file is missing or malformed, or auth is off where it must be on."""


@dataclass(frozen=True, slots=True)
class ClientGrant:
    name: str
    org_id: str
    agents: frozenset[str]  # {"*"} = every agent of the org

    def allows(self, agent_id: str) -> bool:
        return "*" in self.agents or agent_id in self.agents


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85
    secret: bytes  # z85


def generate_keypair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def check_key_name(name: str) -> None:
    """A key name becomes NAME.key and NAME.pub inside the key directory: never a path, never hidden."""
    if _IDENT.fullmatch(name) is None or name.startswith("."):
        raise AuthConfigError(f"--name {name!r} is not a key name: {_IDENT_HELP}, not starting with '.'")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create PATH with MODE and write TEXT; O_EXCL so an existing file is never replaced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public + secret, mode 0600) and NAME.pub in DIRECTORY; refuse to overwrite.

    Nothing is written outside DIRECTORY (the name is checked first) and a half-written pair is
    removed, so a failed call leaves no secret behind.
    """
    check_key_name(name)
    if directory.exists() and not directory.is_dir():
        raise AuthConfigError(f"--dir {directory} is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AuthConfigError(f"cannot create key directory {directory}: {_os_reason(exc)}") from exc
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (key_path, pub_path):
        if path.exists():
            raise AuthConfigError(f"{path} already exists; refusing to overwrite a key")
    kp = generate_keypair()
    secret = json.dumps({"public_key": kp.public.decode(), "secret_key": kp.secret.decode()})
    try:
        _write_new(key_path, secret, 0o600)
    except OSError as exc:
        raise AuthConfigError(f"cannot write {key_path}: {_os_reason(exc)}") from exc
    try:
        _write_new(pub_path, kp.public.decode() + "\n", 0o644)
    except OSError as exc:
        key_path.unlink(missing_ok=True)
        raise AuthConfigError(f"cannot write {pub_path}: {_os_reason(exc)}") from exc
    return key_path, pub_path


def load_keypair(path: str | Path) -> KeyPair:
    try:
        doc = json.loads(Path(path).read_text())
        kp = KeyPair(doc["public_key"].encode(), doc["secret_key"].encode())
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise AuthConfigError(f"cannot read key file {path}: {exc}") from exc
    _check_z85(kp.public, str(path))
    _check_z85(kp.secret, str(path))
    return kp


def load_public_key(value: str) -> bytes:
    """A z85 public key given inline or as the path of a .pub / .key file."""
    if len(value) == 40 and not os.path.exists(value):
        key = value.encode()
    else:
        try:
            text = Path(value).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read public key {value}: {exc}") from exc
        # A bare z85 key is 40 characters and may itself start with "{" (it is in the alphabet), so
        # only a longer text is read as the JSON keypair file.
        if len(text) != 40 and text.startswith("{"):
            try:
                text = str(json.loads(text)["public_key"])
            except (ValueError, KeyError, TypeError) as exc:
                raise AuthConfigError(f"{value}: not a public key file (JSON without public_key)") from exc
        key = text.encode()
    _check_z85(key, value)
    return key


def _check_z85(key: bytes, where: str) -> None:
    try:
        if len(z85.decode(key)) != 32:
            raise ValueError
    except Exception as exc:
        raise AuthConfigError(f"{where}: not a 40-character z85 CURVE key") from exc


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
    _check_z85(key, where)
    return key


def _client_grant(entry: dict[str, Any], index: int, where: str) -> ClientGrant:
    org_id, name = entry.get("org_id"), entry.get("name", f"client-{index}")
    if not isinstance(org_id, str) or _IDENT.fullmatch(org_id) is None:
        raise AuthConfigError(f"{where}: org_id must be an org id ({_IDENT_HELP})")
    agents = entry.get("agents", ["*"])
    if (not isinstance(agents, list) or not agents
            or not all(isinstance(a, str) and (a == "*" or _IDENT.fullmatch(a)) for a in agents)):
        raise AuthConfigError(f"{where}: agents must be a non-empty list of agent ids or \"*\"")
    if not isinstance(name, str):
        raise AuthConfigError(f"{where}: name must be a string")
    return ClientGrant(name, org_id, frozenset(agents))


@dataclass(frozen=True, slots=True)
class _Claim:
    """Where a public key was first listed: one role per key (README, Authentication)."""

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
    if _IDENT.fullmatch(org_id) is None:
        raise AuthConfigError(f"--org {org_id!r} is not an org id ({_IDENT_HELP})")
    bad = [a for a in agents or [] if a != "*" and _IDENT.fullmatch(a) is None]
    if bad:
        raise AuthConfigError(f"--agents {bad[0]!r} is not an agent id ({_IDENT_HELP}) or *")
    entry.update(org_id=org_id, agents=agents or ["*"])
    return entry


def register(keys_file: Path, *, public_key: bytes, role: str, name: str, org_id: str | None = None,
             agents: list[str] | None = None, replace: bool = False) -> bool:
    """Add one key to the keys file; with REPLACE, change the entry of a key already in ROLE.

    A key registered in either role is refused unless REPLACE is set, and a key is never given the
    other role, even with REPLACE (README, Authentication). A keys file the broker would refuse is
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
        raise AuthConfigError(f"cannot write keys file {path}: {_os_reason(exc)}") from exc


def _printable(endpoint: str) -> str:
    return endpoint if endpoint.isprintable() else repr(endpoint)


def exposure(endpoint: str) -> str | None:
    """Why binding ENDPOINT without authentication could be reached from another host; None if local.

    The verdict is ``shared.netloc.is_local_endpoint``; this only explains a refusal in one phrase.
    """
    if is_local_endpoint(endpoint):
        return None
    if not endpoint.startswith("tcp://"):
        return "only tcp://, ipc:// and inproc:// endpoints are known to be local"
    if ";" in endpoint:
        return "the ';' source-address syntax is not accepted (ZeroMQ binds the part after ';')"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep:
        return "a tcp endpoint needs host:port"
    if ":" in host and not host.startswith("["):
        return "an IPv6 host needs brackets, e.g. tcp://[::1]:5555"
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return (f"host {host!r} is not an IP literal or 'localhost' "
                "(names, interfaces and '*' are resolved at bind time)")
    if not ip.is_loopback:
        return f"{host} is not a loopback address"
    return f"port {port!r} is not a number or '*'"


def require_auth_or_loopback(endpoints: list[str], auth_on: bool) -> None:
    """Without a keys file, refuse every endpoint another host could reach (README, Authentication)."""
    if auth_on:
        return
    for endpoint in endpoints:
        reason = exposure(endpoint)
        if reason is not None:
            raise AuthConfigError(
                f"refusing to bind {_printable(endpoint)} without authentication: {reason}; set "
                "IBEX_AUTH_KEYS_FILE and IBEX_BROKER_KEY_FILE (see README, Authentication), or bind only "
                "loopback IP literals, localhost or ipc"
            )


def curve_server(keypair: KeyPair, domain: str) -> Callable[[zmq.Socket[Any]], None]:
    def configure(sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_secretkey = keypair.secret
        sock.curve_publickey = keypair.public
        sock.zap_domain = domain.encode()

    return configure


def curve_client(keypair: KeyPair, server_public: bytes) -> Callable[[zmq.Socket[Any]], None]:
    def configure(sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = keypair.secret
        sock.curve_publickey = keypair.public
        sock.curve_serverkey = server_public

    return configure


class MissingBrokerKey(AuthConfigError):
    """A client or worker key file is set but the broker's public key is not."""


def curve_client_for(role: str, settings: Settings) -> Callable[[zmq.Socket[Any]], None] | None:
    """The CURVE client setup of a ``client`` or ``worker`` from its settings, or None when its key
    file is unset (README: Authentication (CURVE + ZAP)). Raises ``MissingBrokerKey`` when the key
    file is set without ``IBEX_BROKER_PUBLIC_KEY``, ``AuthConfigError`` for an unreadable key."""
    key_file = settings.client_key_file if role == "client" else settings.worker_key_file
    if not key_file:
        return None
    if not settings.broker_public_key:
        raise MissingBrokerKey(f"IBEX_{role.upper()}_KEY_FILE is set but IBEX_BROKER_PUBLIC_KEY is not")
    return curve_client(load_keypair(key_file), load_public_key(settings.broker_public_key))
