"""CURVE keys and socket setup: keypair files, public keys, and the client/server socket options
(docs/security.md "Authentication"). ``shared.security.keyring`` maps keys to orgs; ``shared.security.auth`` is
the one import callers use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from ..config.settings import CommonSettings
from ..stores.keys import is_ident

FRONT_DOMAIN = "ibex-front"
BACK_DOMAIN = "ibex-back"
ROLES = ("client", "worker")
# Org and agent ids in grants, and key names (they become NAME.key / NAME.pub): the identifier
# alphabet of the wire envelope, so a name is never a path and never a hidden file.
IDENT_HELP = "1-64 characters of A-Z a-z 0-9 _ . -"


class AuthConfigError(Exception):
    """A keys file or key file is missing or malformed, or auth is off where it must be on."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85
    secret: bytes  # z85


def generate_keypair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def check_key_name(name: str) -> None:
    """A key name becomes NAME.key and NAME.pub inside the key directory: never a path, never hidden."""
    if not is_ident(name) or name.startswith("."):
        raise AuthConfigError(f"--name {name!r} is not a key name: {IDENT_HELP}, not starting with '.'")


def os_reason(exc: OSError) -> str:
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
        raise AuthConfigError(f"cannot create key directory {directory}: {os_reason(exc)}") from exc
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (key_path, pub_path):
        if path.exists():
            raise AuthConfigError(f"{path} already exists; refusing to overwrite a key")
    kp = generate_keypair()
    secret = json.dumps({"public_key": kp.public.decode(), "secret_key": kp.secret.decode()})
    try:
        _write_new(key_path, secret, 0o600)
    except OSError as exc:
        raise AuthConfigError(f"cannot write {key_path}: {os_reason(exc)}") from exc
    try:
        _write_new(pub_path, kp.public.decode() + "\n", 0o644)
    except OSError as exc:
        key_path.unlink(missing_ok=True)
        raise AuthConfigError(f"cannot write {pub_path}: {os_reason(exc)}") from exc
    return key_path, pub_path


def load_keypair(path: str | Path) -> KeyPair:
    try:
        doc = json.loads(Path(path).read_text())
        kp = KeyPair(doc["public_key"].encode(), doc["secret_key"].encode())
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise AuthConfigError(f"cannot read key file {path}: {exc}") from exc
    check_z85(kp.public, str(path))
    check_z85(kp.secret, str(path))
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
    check_z85(key, value)
    return key


def check_z85(key: bytes, where: str) -> None:
    try:
        if len(z85.decode(key)) != 32:
            raise ValueError
    except Exception as exc:
        raise AuthConfigError(f"{where}: not a 40-character z85 CURVE key") from exc


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


def curve_client_for(key_file: str | None, settings: CommonSettings, *,
                     role: str) -> Callable[[zmq.Socket[Any]], None] | None:
    """The CURVE client setup of a ``client`` or ``worker`` from its key file and the broker's
    public key, or None when the key file is unset (docs/security.md "Authentication"). Raises
    ``MissingBrokerKey`` when the key file is set without ``IBEX_BROKER_PUBLIC_KEY``,
    ``AuthConfigError`` for an unreadable key."""
    if not key_file:
        return None
    if not settings.broker_public_key:
        raise MissingBrokerKey(f"IBEX_{role.upper()}_KEY_FILE is set but IBEX_BROKER_PUBLIC_KEY is not")
    return curve_client(load_keypair(key_file), load_public_key(settings.broker_public_key))
