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
  ``shared.security.netloc.is_local_endpoint`` (strict: no ``;`` source-address form, IP literals or
  ``localhost`` only), because ZeroMQ binds the part after ``;`` and resolves names at bind time.

The implementation is split by concern: ``shared.security.curve`` (keys and socket options),
``shared.security.keyring`` (the keys file), and here the refusal to bind beyond loopback without auth.
Callers import everything from this module.
"""

from __future__ import annotations

import ipaddress

from .curve import (
    BACK_DOMAIN,
    FRONT_DOMAIN,
    ROLES,
    AuthConfigError,
    KeyPair,
    MissingBrokerKey,
    check_key_name,
    curve_client,
    curve_client_for,
    curve_server,
    generate_keypair,
    load_keypair,
    load_public_key,
    write_keypair,
)
from .keyring import ClientGrant, KeyRing, register
from .netloc import is_local_endpoint

__all__ = [
    "BACK_DOMAIN", "FRONT_DOMAIN", "ROLES", "AuthConfigError", "ClientGrant", "KeyPair", "KeyRing",
    "MissingBrokerKey", "check_key_name", "curve_client", "curve_client_for", "curve_server", "exposure",
    "generate_keypair", "load_keypair", "load_public_key", "register", "require_auth_or_loopback",
    "write_keypair",
]


def _printable(endpoint: str) -> str:
    return endpoint if endpoint.isprintable() else repr(endpoint)


def exposure(endpoint: str) -> str | None:
    """Why binding ENDPOINT without authentication could be reached from another host; None if local.

    The verdict is ``shared.security.netloc.is_local_endpoint``; this only explains a refusal in one phrase.
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
    """Without a keys file, refuse every endpoint another host could reach (docs/security.md "Authentication")."""
    if auth_on:
        return
    for endpoint in endpoints:
        reason = exposure(endpoint)
        if reason is not None:
            raise AuthConfigError(
                f"refusing to bind {_printable(endpoint)} without authentication: {reason}; set "
                "IBEX_AUTH_KEYS_FILE and IBEX_BROKER_KEY_FILE (see docs/security.md 'Authentication'), or bind only "
                "loopback IP literals, localhost or ipc"
            )
