"""The CURVE key ``up`` and ``status`` ask the broker's STATUS with when authentication is on.

With ``IBEX_AUTH_KEYS_FILE`` set the broker's frontend admits only client keys listed in the keys
file (docs/security.md "Authentication"), its STATUS request included. On the broker's host the launcher
uses ``IBEX_CLIENT_KEY_FILE`` when that key is listed as a client; otherwise it keeps a keypair of
its own in the run dir (``keys/ops.key``, 0600) and registers it once in the keys file as client
``ops-HOST`` of org ``ibex-ops``, an org no tenant uses, so the key can read the broker's counters
and nothing of any tenant. The broker's public key comes from ``IBEX_BROKER_PUBLIC_KEY`` or the
broker's own key file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from ..shared.config.settings import Settings
from ..shared.security import auth

OPS_ORG = "ibex-ops"
OPS_AGENT = "status"


@dataclass(frozen=True, slots=True)
class StatusKey:
    """A client key file the broker admits and the broker's public key (z85)."""

    key_file: str
    broker_public: str

    def configure(self) -> Callable[[zmq.Socket[Any]], None]:
        return auth.curve_client(auth.load_keypair(self.key_file), self.broker_public.encode())


def broker_public_key(settings: Settings) -> bytes | None:
    """The broker's public key: ``IBEX_BROKER_PUBLIC_KEY``, else the public half of ``IBEX_BROKER_KEY_FILE``."""
    if settings.broker_public_key:
        return auth.load_public_key(settings.broker_public_key)
    if settings.broker_key_file:
        return auth.load_keypair(settings.broker_key_file).public
    return None


def broker_host_key(settings: Settings, run_dir: Path, host: str) -> tuple[StatusKey | None, str | None]:
    """(the key for STATUS, a line to print when one was registered) on a host running the broker.

    ``(None, None)`` when authentication is off. Raises ``AuthConfigError`` with one line when no
    usable key can be had (an unlisted ``IBEX_CLIENT_KEY_FILE``, a keys file that cannot be written).
    """
    if not settings.auth_keys_file:
        return None, None
    public = broker_public_key(settings)
    if public is None:
        raise auth.AuthConfigError("IBEX_AUTH_KEYS_FILE is set but IBEX_BROKER_KEY_FILE is not")
    keys_file = Path(settings.auth_keys_file)
    ring = auth.KeyRing.load(keys_file)
    if settings.client_key_file:
        if auth.load_keypair(settings.client_key_file).public not in ring.clients:
            raise auth.AuthConfigError(f"IBEX_CLIENT_KEY_FILE {settings.client_key_file} is not a client key in "
                                       f"{keys_file}, so the broker would refuse its STATUS request; register it "
                                       "or unset IBEX_CLIENT_KEY_FILE (up then registers a key of its own)")
        return StatusKey(settings.client_key_file, public.decode()), None
    key_dir = run_dir / "keys"
    key_file = key_dir / "ops.key"
    if not key_file.exists():
        (key_dir / "ops.pub").unlink(missing_ok=True)  # a lone public half is useless
        auth.write_keypair(key_dir, "ops")
    mine = auth.load_keypair(key_file).public
    if mine in ring.clients:
        return StatusKey(str(key_file), public.decode()), None
    name = f"ops-{host}"[:64]
    try:
        auth.register(keys_file, public_key=mine, role="client", name=name, org_id=OPS_ORG, agents=[OPS_AGENT])
    except auth.AuthConfigError as exc:
        raise auth.AuthConfigError(f"{exc}; the STATUS probe needs a client key the broker admits: set "
                                   "IBEX_CLIENT_KEY_FILE to a registered client key") from None
    return StatusKey(str(key_file), public.decode()), (
        f"ibex-context: registered {key_dir / 'ops.pub'} in {keys_file} as client {name!r} "
        f"(org {OPS_ORG}: the broker's STATUS for up and status, no tenant's data)")


def client_key(settings: Settings) -> StatusKey | None:
    """On a host without the broker: ``IBEX_CLIENT_KEY_FILE`` and ``IBEX_BROKER_PUBLIC_KEY``, when both are set."""
    if not settings.client_key_file or not settings.broker_public_key:
        return None
    return StatusKey(settings.client_key_file, auth.load_public_key(settings.broker_public_key).decode())
