"""One memories-block nonce secret per deployment, checked through Redis.

Every worker must derive the same nonce for the same memories, or a proxy's prompt-cache prefix
changes whenever consecutive calls land on workers of different hosts (docs/assembly.md "Prompt caching").
The secret itself never leaves the hosts' environment: Redis holds only its fingerprint, an
HMAC-SHA256 of a constant under the nonce key, so a Redis backup, replica or ``MONITOR`` never
carries a key a memory author could use to forge the block's closing tag.

The fingerprint is a lease, not a record: every host running workers keeps it alive (the
``nonce-lease`` program under supervisord, ``python -m ibex_context.ops.nonce``), and it expires
``LEASE_TTL_S`` after the last such host stops. So a host whose secret differs is refused while
any host of the deployment serves with another one, and rotating the secret is: stop every
workers host, wait ``LEASE_TTL_S``, start them with the new one (docs/deploy.md "Deploying on several
machines").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import signal
import sys
import threading
from typing import Any

# No ':' in the key, so it cannot match any org's key pattern (shared.stores.keys.org_key_patterns):
# flushing an org's keys never drops it, and no org id can name it.
FINGERPRINT_KEY = "ibex-context/nonce-fingerprint"
LEASE_TTL_S = 30
REFRESH_S = 5.0
_FINGERPRINT_MESSAGE = b"ibex-context nonce fingerprint v1"

# Claim the lease if free (2), extend it if ours (1); 0 when another fingerprint holds it. One
# script, so two hosts starting at once cannot both claim it.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 2
end
if held == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# Drop the lease only while it still holds this fingerprint.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
CLAIMED, EXTENDED, HELD_BY_ANOTHER = 2, 1, 0

log = logging.getLogger(__name__)


def fingerprint(nonce_key: bytes) -> str:
    """The deployment-wide check value of a nonce key (``pipeline.format.nonce_key``): HMAC of a constant."""
    return hmac.new(nonce_key, _FINGERPRINT_MESSAGE, hashlib.sha256).hexdigest()


def worker_fingerprint(nonce_secret: str | None, memory_secret: str) -> str:
    """The fingerprint of the key the workers of a host with these settings derive nonces with."""
    from ..pipeline.format import nonce_key

    return fingerprint(nonce_key(nonce_secret, memory_secret))


def claim(redis: Any, fp: str, ttl_s: int = LEASE_TTL_S) -> bool:
    """Take or extend the deployment's fingerprint lease; False when another fingerprint holds it."""
    return bool(take(redis, fp, ttl_s))


def take(redis: Any, fp: str, ttl_s: int = LEASE_TTL_S) -> int:
    """``CLAIMED`` (the lease was free), ``EXTENDED`` (it held ``fp``) or ``HELD_BY_ANOTHER``."""
    return int(redis.eval(_CLAIM, 1, FINGERPRINT_KEY, fp, ttl_s))


def release(redis: Any, fp: str) -> None:
    """Drop the lease if it still holds ``fp``: a start that claimed it and then failed leaves no
    fingerprint behind to refuse the next attempt (docs/deploy.md "Adding a workers host")."""
    redis.eval(_RELEASE, 1, FINGERPRINT_KEY, fp)


def refusal() -> str:
    """The one line a host whose nonce secret differs from the running workers' gets."""
    return ("IBEX_NONCE_SECRET differs from the one this deployment's running workers use (their fingerprint "
            f"is in Redis at {FINGERPRINT_KEY}): set the same IBEX_NONCE_SECRET on every host "
            "(`ibex-context workers-env` on the first host prints it); to rotate it, stop every workers host "
            f"first (the lease expires {LEASE_TTL_S} s after the last one)")


def refused(redis: Any, fp: str) -> str | None:
    """Why this host's workers must not start (one line), or None once the lease is this host's."""
    return None if claim(redis, fp) else refusal()


def main() -> int:
    """The lease keeper of one workers host: refresh every ``REFRESH_S``; log an error while another holds it."""
    import redis

    from ..shared.config.observability import setup_logging
    from ..shared.config.settings import WorkerSettings

    settings = WorkerSettings()
    setup_logging(settings.log_level, "nonce-lease", settings.log_format)
    if not settings.redis_url:
        print("nonce-lease: IBEX_REDIS_URL is not set", file=sys.stderr)
        return 2
    fp = worker_fingerprint(settings.nonce_secret, settings.memory_secret)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from ..shared.stores.connect import sync_client

    client = sync_client(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    held = True
    while not stop.is_set():
        try:
            ours = claim(client, fp)
        except redis.RedisError as exc:
            log.warning("nonce lease not refreshed: %s", exc)
        else:
            if not ours:
                log.error("another nonce secret holds %s: this host's workers use a different "
                          "IBEX_NONCE_SECRET than the deployment's", FINGERPRINT_KEY)
            elif not held:
                log.info("nonce lease held again")
            held = ours
        stop.wait(REFRESH_S)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
