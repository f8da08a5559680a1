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
* Without a keys file, binding anything but loopback or ipc is refused at start-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import zmq
from zmq.utils import z85

from shared.codec import Envelope
from shared.errors import Forbidden, Unauthenticated

FRONT_DOMAIN = "ibex-front"
BACK_DOMAIN = "ibex-back"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


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


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public + secret, mode 0600) and NAME.pub; refuse to overwrite."""
    directory.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    if key_path.exists():
        raise AuthConfigError(f"{key_path} already exists; refusing to overwrite a secret key")
    kp = generate_keypair()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"public_key": kp.public.decode(), "secret_key": kp.secret.decode()}, f)
    pub_path.write_text(kp.public.decode() + "\n")
    return key_path, pub_path


def load_keypair(path: str | Path) -> KeyPair:
    try:
        doc = json.loads(Path(path).read_text())
        kp = KeyPair(doc["public_key"].encode(), doc["secret_key"].encode())
    except (OSError, ValueError, KeyError, AttributeError) as exc:
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
        except OSError as exc:
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


class KeyRing:
    """The keys file, loaded once: client key -> grant, and the set of worker keys."""

    def __init__(self, clients: dict[bytes, ClientGrant], workers: set[bytes]) -> None:
        self.clients = clients
        self.workers = workers

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        try:
            doc: Any = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise AuthConfigError(f"cannot read keys file {path}: {exc}") from exc
        if not isinstance(doc, dict):
            raise AuthConfigError(f"keys file {path}: expected an object with clients and workers")
        clients: dict[bytes, ClientGrant] = {}
        for i, c in enumerate(doc.get("clients", [])):
            try:
                key = c["public_key"].encode()
                _check_z85(key, f"{path}: clients[{i}]")
                agents = c.get("agents", ["*"])
                if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
                    raise AuthConfigError(f"{path}: clients[{i}].agents must be a list of strings")
                clients[key] = ClientGrant(str(c.get("name", f"client-{i}")), str(c["org_id"]), frozenset(agents))
            except (KeyError, TypeError, AttributeError) as exc:
                raise AuthConfigError(f"{path}: clients[{i}] needs public_key and org_id") from exc
        workers: set[bytes] = set()
        for i, w in enumerate(doc.get("workers", [])):
            try:
                key = w["public_key"].encode()
            except (KeyError, TypeError, AttributeError) as exc:
                raise AuthConfigError(f"{path}: workers[{i}] needs public_key") from exc
            _check_z85(key, f"{path}: workers[{i}]")
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


def register(keys_file: Path, *, public_key: bytes, role: str, name: str, org_id: str | None = None,
             agents: list[str] | None = None) -> None:
    """Add (or replace) one key in the keys file."""
    doc: dict[str, Any] = {"clients": [], "workers": []}
    if keys_file.exists():
        doc = json.loads(keys_file.read_text())
    entry: dict[str, Any] = {"name": name, "public_key": public_key.decode()}
    if role == "client":
        if not org_id:
            raise AuthConfigError("a client key needs --org")
        entry.update(org_id=org_id, agents=agents or ["*"])
        doc["clients"] = [c for c in doc.get("clients", []) if c.get("public_key") != entry["public_key"]] + [entry]
    elif role == "worker":
        doc["workers"] = [w for w in doc.get("workers", []) if w.get("public_key") != entry["public_key"]] + [entry]
    else:
        raise AuthConfigError("role must be client or worker")
    tmp = keys_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(keys_file)


def is_local(endpoint: str) -> bool:
    """ipc://, inproc:// and loopback tcp:// endpoints need no authentication."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if endpoint.startswith("tcp://"):
        host = urlparse(endpoint).hostname or ""
        return host in LOOPBACK_HOSTS or host.startswith("127.")
    return False


def require_auth_or_loopback(endpoints: list[str], auth_on: bool) -> None:
    exposed = [e for e in endpoints if not is_local(e)]
    if exposed and not auth_on:
        raise AuthConfigError(
            f"refusing to bind {', '.join(exposed)} without authentication: set IBEX_AUTH_KEYS_FILE and "
            "IBEX_BROKER_KEY_FILE (see README, Authentication), or bind only loopback/ipc"
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
