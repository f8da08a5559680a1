"""Org credentials: HMAC-signed bearer tokens that carry the org id.

Workers mint one token per org with the shared secret (``Settings.memory_secret``, env
``IBEX_MEMORY_SECRET``); the memory service verifies it and takes the org id from the token
alone, never from a query parameter or a body, so a caller cannot name another tenant.

Format: ``ibex1.<org_id>.<hex HMAC-SHA256(secret, "ibex-org-token:v1:" + org_id)>``. The org id
may itself contain dots, so the signature is split off from the right. Tokens do not expire;
rotating the secret revokes all of them (a reference design for a trusted network, not an IdP).
"""

from __future__ import annotations

import hashlib
import hmac

from ..stores.keys import check_ident, is_ident

TOKEN_PREFIX = "ibex1."
_DOMAIN = b"ibex-org-token:v1:"  # domain separation: this MAC signs nothing else
_SIG_HEX_LEN = 64
_MAX_TOKEN_LEN = len(TOKEN_PREFIX) + 64 + 1 + _SIG_HEX_LEN


def _signature(secret: str, org_id: str) -> str:
    if not secret:
        raise ValueError("the token secret must not be empty")
    return hmac.new(secret.encode(), _DOMAIN + org_id.encode(), hashlib.sha256).hexdigest()


def mint_org_token(secret: str, org_id: str) -> str:
    """A bearer token proving the holder acts for ``org_id`` (``ValueError`` on a bad org id)."""
    check_ident(org_id, "org_id")
    return f"{TOKEN_PREFIX}{org_id}.{_signature(secret, org_id)}"


def verify_org_token(secret: str, token: str) -> str | None:
    """The org id the token was minted for, or ``None`` if it is malformed or forged.

    The signature is compared in constant time; shape checks before it only look at public
    structure (prefix, lengths, alphabet), never at secret-dependent bytes.
    """
    if not isinstance(token, str) or len(token) > _MAX_TOKEN_LEN or not token.startswith(TOKEN_PREFIX):
        return None
    body = token[len(TOKEN_PREFIX):]
    org_id, sep, sig = body.rpartition(".")
    if not sep or not is_ident(org_id) or len(sig) != _SIG_HEX_LEN:
        return None
    expected = _signature(secret, org_id)
    if not hmac.compare_digest(expected.encode(), sig.encode("utf-8")):
        return None
    return org_id


def bearer_token(authorization: str | None) -> str | None:
    """The token out of an ``Authorization: Bearer <token>`` header value, if present."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
