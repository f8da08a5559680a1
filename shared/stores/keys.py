"""Every Redis key the service reads or writes, built in one place.

docs/security.md "Degradation and security": tenant scoping is enforced at the data
layer, so every key names its org in a fixed place. Identifiers are checked against the same safe
alphabet as ``shared.wire.models.Ident``: no ``:``, braces or whitespace, so no org or agent id can
smuggle a separator and name a key in another tenant's namespace. A bad identifier raises
``ValueError``. Braces below are literal: they are Redis Cluster hash tags.

    {ORG}:directive:AGENT                   STRING  JSON DirectiveEnvelope (shared/stores/directives.py)
    {ORG}:summary:AGENT:KEY                 STRING  JSON {text, covers}: a conversation's compaction
                                                    summary (shared/stores/summaries.py)
    {ORG}:calibration:MODEL                 HASH    usage-report ratio sketch (worker/calibration_store.py)
    {ORG}:assembly:ASSEMBLY_ID              STRING  one assembly's own count for its usage report, short TTL
                                                    (worker/calibration_store.py)
    {ORG}:storage                           HASH    the org's storage ledger: Redis bytes charged to it
                                                    (shared/stores/storage.py)
    {ORG}:mem_agents                        SET     the org's agents with memories (memory.store.quotas)
    mem:{ORG:AGENT}:MEMORY_ID               HASH    one memory: org, agent, content, created_at,
                                                    rec (the JSON record), v_{embedder} (float32 vector)
    memids:{ORG:AGENT}                      SET     the agent's memory ids (the per-agent cap)
    hot:{ORG:AGENT}                         ZSET    memory_id -> salience in [0, 1]

Two hash tags, so the layout runs unchanged on one server and on a Redis Cluster
(docs/memory-search.md "Shards"): an org's own keys share the tag ``{ORG}`` (one slot: the Lua
scripts that charge the storage ledger with a calibration or assembly key, and the directive GET
that reads a summary with it, touch keys of one slot); one agent's memory keys share ``{ORG:AGENT}``
(its writes stay atomic, while agents spread over the shards).

Memory keys start with their family, not the org, because the Redis Query Engine indexes hashes
by key prefix (``memory_index``): on one server an index per org and embedder covers the prefix
``mem:{ORG:``; on a cluster, whose query engine may have no coordinator (an index lives on the
shard of its name's slot and sees only that shard's documents), an index per agent carries the
agent's tag in its name, so it lives on the shard of the agent's memories.
"""

from __future__ import annotations

import re
from typing import TypeGuard

from ..wire.models import IDENT_CHARS, SUMMARY_KEY_CHARS

IDENT_PATTERN = f"^{IDENT_CHARS}$"  # as written in error messages
_IDENT = re.compile(IDENT_CHARS)
_SUMMARY_KEY = re.compile(SUMMARY_KEY_CHARS)


def is_ident(value: object) -> TypeGuard[str]:
    """True when ``value`` may be an org, agent, memory or embedder id inside a key."""
    return isinstance(value, str) and _IDENT.fullmatch(value) is not None


def check_ident(value: object, what: str = "identifier") -> str:
    """Return ``value`` unchanged if it is a safe identifier, else raise ``ValueError``."""
    if not is_ident(value):
        raise ValueError(f"{what} must match {IDENT_PATTERN} (got {value!r:.80})")
    assert isinstance(value, str)
    return value


def org_tag(org_id: str) -> str:
    """``{org}``: the hash tag every key of the org's own (not its memories) carries."""
    return "{" + check_ident(org_id, "org_id") + "}"


def org_prefix(org_id: str) -> str:
    """The prefix every key of one org starts with (for scans and per-org cleanup)."""
    return f"{org_tag(org_id)}:"


def directive_key(org_id: str, agent_id: str) -> str:
    return f"{org_tag(org_id)}:directive:{check_ident(agent_id, 'agent_id')}"


def summary_key(org_id: str, agent_id: str, key: str) -> str:
    """One conversation's stored summary. ``key`` is the caller's opaque conversation key; it
    comes last, after the org and the agent (neither may hold ``:``), so whatever it holds the key
    stays in that org's and agent's namespace."""
    if not isinstance(key, str) or _SUMMARY_KEY.fullmatch(key) is None:
        raise ValueError(f"summary_key must match ^{SUMMARY_KEY_CHARS}$ (got {key!r:.80})")
    return f"{org_tag(org_id)}:summary:{check_ident(agent_id, 'agent_id')}:{key}"


def agent_tag(org_id: str, agent_id: str) -> str:
    """``{org:agent}``: the hash tag every memory key of one agent carries."""
    return "{" + f"{check_ident(org_id, 'org_id')}:{check_ident(agent_id, 'agent_id')}" + "}"


MEMORY_PREFIX = "mem:"  # the Redis Query Engine indexes cover keys with this prefix


def memory_index(embedder: str, org_id: str, agent_id: str, *, per_agent: bool) -> tuple[str, str]:
    """The name of the index an agent's memories are searched in, and the key prefix it covers.

    ``per_agent`` (a Redis Cluster): ``ibex:mem:EMBEDDER:{ORG:AGENT}`` over the agent's keys, on the
    agent's shard; else ``ibex:mem:EMBEDDER:ORG`` over every agent of the org (BM25 statistics
    per org). Vectors of unlike embedders never share an index.
    """
    emb = check_ident(embedder, "embedder")
    if per_agent:
        return f"ibex:mem:{emb}:{agent_tag(org_id, agent_id)}", memory_key_prefix(org_id, agent_id)
    org = check_ident(org_id, "org_id")
    check_ident(agent_id, "agent_id")
    return f"ibex:mem:{emb}:{org}", MEMORY_PREFIX + "{" + org + ":"


def memory_key(org_id: str, agent_id: str, memory_id: str) -> str:
    return f"{MEMORY_PREFIX}{agent_tag(org_id, agent_id)}:{check_ident(memory_id, 'memory_id')}"


def memory_key_prefix(org_id: str, agent_id: str) -> str:
    """What every memory key of one agent starts with (its id follows)."""
    return f"{MEMORY_PREFIX}{agent_tag(org_id, agent_id)}:"


def memory_ids_key(org_id: str, agent_id: str) -> str:
    return f"memids:{agent_tag(org_id, agent_id)}"


def hot_key(org_id: str, agent_id: str) -> str:
    return f"hot:{agent_tag(org_id, agent_id)}"


def org_memory_agents_key(org_id: str) -> str:
    """The org's agents that have memories (the agents-per-org quota, ``memory.store.quotas``)."""
    return f"{org_tag(org_id)}:mem_agents"


def org_storage_key(org_id: str) -> str:
    """The org's storage ledger: the Redis bytes its data is charged (``shared.stores.storage``)."""
    return f"{org_tag(org_id)}:storage"


def org_key_patterns(org_id: str) -> tuple[str, ...]:
    """SCAN patterns that together match every key of one org (per-org cleanup)."""
    org = check_ident(org_id, "org_id")
    return (f"{{{org}}}:*", f"{MEMORY_PREFIX}{{{org}:*", f"memids:{{{org}:*", f"hot:{{{org}:*")


def vector_field(embedder: str) -> str:
    """The hash field holding a memory's vector for one embedder (vectors of unlike models never mix)."""
    return f"v_{check_ident(embedder, 'embedder').replace('-', '_').replace('.', '_')}"


def states_field(embedder: str) -> str:
    """The hash field holding a memory's token states for one embedder (``memory.embedders.token_states``;
    not indexed: only the late-interaction rerank reads it)."""
    return f"t_{check_ident(embedder, 'embedder').replace('-', '_').replace('.', '_')}"


def calibration_key(org_id: str, model: str) -> str:
    """One (org, model) calibration sketch: scoped by org, so one tenant's reports move only its own
    budgets. ``model`` is the catalog's name for it (aliases and dated ids share one key)."""
    return f"{org_tag(org_id)}:calibration:{check_ident(model, 'model')}"


def assembly_key(org_id: str, assembly_id: str) -> str:
    """The service's record of one assembly it issued ``assembly_id`` for: under the org that
    assembled, so a report from another org never finds it."""
    return f"{org_tag(org_id)}:assembly:{check_ident(assembly_id, 'assembly_id')}"
