"""Checks against the running deployment before a host's workers start (``ibex-context up``).

The settings every host must share are compared with what the deployment already uses, each
failure one line naming the setting: the Redis answers at ``IBEX_REDIS_URL``, the memory service
at ``IBEX_MEMORY_URL`` accepts a token minted with this host's ``IBEX_MEMORY_SECRET``, and this
host's nonce secret has the fingerprint the running workers hold in Redis (``ops.nonce``). The
nonce lease is taken last, once everything else agrees, so a host refused for another setting
leaves no fingerprint behind; ``up`` releases a lease it took when its start fails after all.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from ..shared.config.settings import Settings
from ..shared.security.tenancy import mint_org_token
from . import nonce

PROBE_ORG = "ibex-ops"  # an org no tenant uses: its hot list is empty, reading it changes nothing
PROBE_AGENT = "status"


class CheckFailed(Exception):
    """A shared setting disagrees with the deployment (``code`` 2) or a service does not answer (1)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def redacted(url: str) -> str:
    """A URL without its password, for messages and ``status``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.netloc.rpartition("@")[2]
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparseable URL>"


def redis_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    """A client for the server or the cluster ``url`` names (``shared.stores.connect``)."""
    from ..shared.stores.connect import sync_client

    try:
        return sync_client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except redis.exceptions.RedisClusterException as exc:  # a cluster client reads the slot map at once
        raise redis.ConnectionError(str(exc)) from None


def redis_ok(url: str) -> bool:
    try:
        with redis_client(url, 0.5) as client:
            return bool(client.ping())
    except (redis.RedisError, ValueError):
        return False


def memory_secret_accepted(url: str, secret: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the memory service at ``url`` accepts a token minted with ``secret``; None if it does not answer.
    httpx is imported here: ``status`` and ``down`` load this module but never call it."""
    import httpx

    token = mint_org_token(secret, PROBE_ORG)
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/memories/hot", params={"agent_id": PROBE_AGENT, "limit": 1},
                      headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return r.status_code != 401


def check_workers_host(settings: Settings, env: dict[str, str]) -> str | None:
    """Everything a host's workers need from the deployment, before they start (``CheckFailed``).

    Returns the fingerprint when this check took a free nonce lease (for ``release_lease`` should
    the start fail), None when the lease already held this host's fingerprint.
    """
    url = env["IBEX_REDIS_URL"]
    try:
        with redis_client(url) as client:
            client.ping()
    except (redis.RedisError, ValueError) as exc:
        raise CheckFailed(f"the Redis at IBEX_REDIS_URL {redacted(url)} does not answer: {exc}", 1) from None
    memory = env["IBEX_MEMORY_URL"]
    accepted = memory_secret_accepted(memory, settings.memory_secret)
    if accepted is None:
        raise CheckFailed(f"the memory service at IBEX_MEMORY_URL {redacted(memory)} does not answer", 1)
    if not accepted:
        raise CheckFailed(f"the memory service at IBEX_MEMORY_URL {redacted(memory)} refuses tokens minted with "
                          "this host's IBEX_MEMORY_SECRET: set the same IBEX_MEMORY_SECRET on every host "
                          "(`ibex-context workers-env` on the first host prints it)", 2)
    fp = nonce.worker_fingerprint(env.get("IBEX_NONCE_SECRET"), settings.memory_secret)
    try:
        with redis_client(url) as client:
            taken = nonce.take(client, fp)
    except (redis.RedisError, ValueError) as exc:
        raise CheckFailed(f"the Redis at IBEX_REDIS_URL {redacted(url)} does not answer: {exc}", 1) from None
    if taken == nonce.HELD_BY_ANOTHER:
        raise CheckFailed(nonce.refusal(), 2)
    return fp if taken == nonce.CLAIMED else None


def release_lease(url: str, fp: str) -> None:
    """Drop a nonce lease this host took for a start that then failed (best effort: it expires anyway)."""
    try:
        with redis_client(url) as client:
            nonce.release(client, fp)
    except (redis.RedisError, ValueError):
        pass
