"""Every Redis key the service reads or writes, built in one place.

README (Degradation and security): tenant scoping is enforced at the data
layer, so each key starts with the org id. Identifiers are checked against the same safe
alphabet as ``shared.models.Ident``: no ``:`` or whitespace, so no org or agent id can smuggle a
separator and name a key in another tenant's namespace. A bad identifier raises ``ValueError``.

    {org}:directive:{agent}                 STRING  JSON DirectiveEnvelope (shared/directives.py)
    {org}:hot_memories:{agent}              ZSET    memory_id -> salience in [0, 1]
    {org}:memories:{agent}                  HASH    memory_id -> JSON memory record
    {org}:memory_terms:{agent}              HASH    memory_id -> space-joined full-text terms
    {org}:memory_vectors:{agent}:{embedder} HASH    memory_id -> float32 unit vector bytes
    {org}:memory_rev:{agent}                STRING  random token, replaced on every memory write
    {org}:calibration:{model}               HASH    usage-report ratio sketch (shared/calibration_store.py)
"""

from __future__ import annotations

import re
from typing import TypeGuard

from ibex_context.shared.models import IDENT_CHARS

IDENT_PATTERN = f"^{IDENT_CHARS}$"  # as written in error messages
_IDENT = re.compile(IDENT_CHARS)


def is_ident(value: object) -> TypeGuard[str]:
    """True when ``value`` may be an org, agent, memory or embedder id inside a key."""
    return isinstance(value, str) and _IDENT.fullmatch(value) is not None


def check_ident(value: object, what: str = "identifier") -> str:
    """Return ``value`` unchanged if it is a safe identifier, else raise ``ValueError``."""
    if not is_ident(value):
        raise ValueError(f"{what} must match {IDENT_PATTERN} (got {value!r:.80})")
    assert isinstance(value, str)
    return value


def org_prefix(org_id: str) -> str:
    """The prefix every key of one org starts with (for scans and per-org cleanup)."""
    return f"{check_ident(org_id, 'org_id')}:"


def directive_key(org_id: str, agent_id: str) -> str:
    return f"{check_ident(org_id, 'org_id')}:directive:{check_ident(agent_id, 'agent_id')}"


def hot_key(org_id: str, agent_id: str) -> str:
    return f"{check_ident(org_id, 'org_id')}:hot_memories:{check_ident(agent_id, 'agent_id')}"


def memories_key(org_id: str, agent_id: str) -> str:
    return f"{check_ident(org_id, 'org_id')}:memories:{check_ident(agent_id, 'agent_id')}"


def terms_key(org_id: str, agent_id: str) -> str:
    return f"{check_ident(org_id, 'org_id')}:memory_terms:{check_ident(agent_id, 'agent_id')}"


def rev_key(org_id: str, agent_id: str) -> str:
    """Changes whenever the agent's memories do, so readers can keep a derived index cached."""
    return f"{check_ident(org_id, 'org_id')}:memory_rev:{check_ident(agent_id, 'agent_id')}"


def vectors_key(org_id: str, agent_id: str, embedder: str) -> str:
    """Vectors are kept per embedder so switching models never compares unlike vectors."""
    return (
        f"{check_ident(org_id, 'org_id')}:memory_vectors:{check_ident(agent_id, 'agent_id')}:"
        f"{check_ident(embedder, 'embedder')}"
    )


def calibration_key(org_id: str, model: str) -> str:
    """One (org, model) calibration sketch: scoped by org, so one tenant's reports move only its own
    budgets. ``model`` is the catalog's name for it (aliases and dated ids share one key)."""
    return f"{check_ident(org_id, 'org_id')}:calibration:{check_ident(model, 'model')}"
