"""Memory writes and record parsing of the memory service; every key comes from ``shared.stores.keys``.

Per memory, written in one MULTI with the agent's id set and hot list (one hash slot), so readers
never see half a memory:

    mem:{org:agent}:{memory_id}  HASH  org, agent, content (the searched text: memory.search.indexed_text),
                                       created_at, rec (MemoryRecord JSON),
                                       v_{embedder} (float32 unit vector), t_{embedder} (its token
                                       states, int8: memory.embedders.token_states; not indexed), q (the Redis
                                       bytes it is charged to its org: shared.stores.storage)
    memids:{org:agent}           SET   the agent's memory ids (the per-agent cap counts them)
    hot:{org:agent}              ZSET  memory_id -> salience (only memories marked hot)

The Redis Query Engine indexes each hash as it is written (``memory.search.index``); nothing here keeps
an index of its own. Vectors are per embedder; a memory without one for the current embedder
(seeded with another, or written straight to Redis) is embedded when a read meets it and the
vector is stored (``store_vectors``).

Reads are total: a record that no longer validates (written straight to Redis, or by an older
version with looser rules) is left out of every answer, logged and counted in ``RecordHealth``
(shown by ``/healthz``), never an error for the agent (docs/security.md "Degradation and security").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from ...shared.stores import storage
from ...shared.stores.keys import hot_key, memory_ids_key, memory_key, states_field, vector_field
from ...shared.wire.validation import first_error
from ..embedders.embed import Vectors
from ..embedders.token_states import Embedded, split_embedded
from ..search.index import tenant_number
from ..search.indexed_text import DATE_WORDS, searched_text
from .quotas import account_write
from .records import MemoryRecord

log = logging.getLogger(__name__)

# Vectors, or vectors with their token states from the same pass (``MemoryService.embed_memories``).
EmbedFn = Callable[[Sequence[str]], Awaitable[Vectors | Embedded]]
_WRITE_CHUNK = 256
_WATCH_ATTEMPTS = 8


class AgentFull(Exception):
    """A write would take the agent over its memory cap (``MemoryConfig.max_memories_per_agent``)."""

    def __init__(self, count: int, cap: int) -> None:
        super().__init__(f"agent has {count} memories, the cap is {cap}")
        self.count = count
        self.cap = cap


class WriteContention(Exception):
    """The agent's records kept changing under a capped write; the caller may retry."""


class RecordHealth:
    """Counts stored records that reads had to skip (damaged, out of range, wrong id)."""

    def __init__(self) -> None:
        self.skipped = 0
        self.last: str | None = None

    def skip(self, where: str, reason: str) -> None:
        self.skipped += 1
        self.last = where
        log.warning("skipping memory record at %s: %s", where, reason)


@dataclass(frozen=True, slots=True)
class NewMemory:
    org_id: str
    agent_id: str
    record: MemoryRecord
    hot: bool


def doc_fields(org_id: str, agent_id: str, rec: MemoryRecord, vec: Vectors | None, embedder_name: str,
               states: bytes | None = None) -> dict[str, str | bytes | float]:
    """The hash of one memory, as the index reads it (``memory.search.index``), with its token states if any."""
    fields: dict[str, str | bytes | float] = {
        "org": org_id, "agent": agent_id, "tenant": tenant_number(org_id, agent_id),
        "content": searched_text(rec.content, rec.created_at),
        "created_at": rec.created_at.timestamp(), "rec": rec.model_dump_json()}
    if vec is not None:
        fields[vector_field(embedder_name)] = np.asarray(vec, dtype=np.float32).tobytes()
    if states:
        fields[states_field(embedder_name)] = states
    return fields


DATE_CHARGE = storage.TOKEN_BYTES * DATE_WORDS  # the indexed date's postings (memory_charge)
CHARGE_FIELD = "q"  # the bytes the memory was charged to its org (shared.stores.storage), credited on rewrite
_CHARGE_DIGITS = 10


def memory_charge(org_id: str, agent_id: str, rec: MemoryRecord, *, hot: bool, embedder_name: str, dim: int,
                  state_bytes: int = 0) -> int:
    """The Redis bytes one memory is charged (``shared.stores.storage.memory_cost``): its hash as
    ``doc_fields`` writes it (with its vector, its ``state_bytes`` of token states and its charge),
    its id entries and its index entries.

    The indexed date's words (``memory.search.indexed_text``) are charged as occurrences only: an org's
    memories share a few dozen day, month and year words, so unlike a content word they are
    almost never new to the index (measured: 46 bytes per memory in Redis, docs/memory-search.md)."""
    fields = doc_fields(org_id, agent_id, rec, None, embedder_name)
    sizes = {name: len(v) if isinstance(v, bytes) else len(str(v).encode()) for name, v in fields.items()}
    sizes[vector_field(embedder_name)] = 4 * dim
    sizes[CHARGE_FIELD] = _CHARGE_DIGITS
    if state_bytes > 0:
        sizes[states_field(embedder_name)] = state_bytes
    return storage.memory_cost(memory_key(org_id, agent_id, rec.memory_id), sizes, rec.content,
                               vector_bytes=4 * dim, id_len=len(rec.memory_id), hot=hot) + DATE_CHARGE


def _queue_write(pipe: Pipeline, m: NewMemory, vec: Vectors, states: bytes | None, embedder_name: str,
                 charge: int) -> None:
    """Queue one memory's hash (with its charge), id and hot flag on a pipeline (all in the agent's
    hash slot). A rewrite without token states drops the old ones (they were of the old content)."""
    rec = m.record
    fields = doc_fields(m.org_id, m.agent_id, rec, vec, embedder_name, states)
    fields[CHARGE_FIELD] = str(charge)
    if not states:
        pipe.hdel(memory_key(m.org_id, m.agent_id, rec.memory_id), states_field(embedder_name))
    pipe.hset(memory_key(m.org_id, m.agent_id, rec.memory_id), mapping=fields)  # type: ignore[arg-type]
    pipe.sadd(memory_ids_key(m.org_id, m.agent_id), rec.memory_id)
    if m.hot:
        pipe.zadd(hot_key(m.org_id, m.agent_id), {rec.memory_id: rec.salience})
    else:
        pipe.zrem(hot_key(m.org_id, m.agent_id), rec.memory_id)


async def write_memories(redis: Redis, items: Sequence[NewMemory], *, embedder_name: str, embed: EmbedFn) -> None:
    """Store memories in chunks: one MULTI/EXEC per agent in each chunk (one hash slot each, so
    the same code runs on a Redis Cluster).

    An operator's seeding: each memory is charged to its org's storage ledger but never refused
    (``shared.stores.storage``), and the memories it rewrites are credited what they were charged.
    """
    for start in range(0, len(items), _WRITE_CHUNK):
        chunk = items[start : start + _WRITE_CHUNK]
        got = split_embedded(await embed([m.record.content for m in chunk]))
        by_agent: dict[tuple[str, str], list[tuple[NewMemory, Vectors, bytes | None]]] = {}
        for m, vec, states in zip(chunk, got.vectors, got.states, strict=True):
            by_agent.setdefault((m.org_id, m.agent_id), []).append((m, vec, states))
        for (org, agent), group in by_agent.items():
            charges = [memory_charge(org, agent, m.record, hot=m.hot, embedder_name=embedder_name, dim=len(vec),
                                     state_bytes=len(states or b"")) for m, vec, states in group]
            async with redis.pipeline(transaction=True) as pipe:
                for m, _, _ in group:
                    pipe.hget(memory_key(org, agent, m.record.memory_id), CHARGE_FIELD)
                for (m, vec, states), charge in zip(group, charges, strict=True):
                    _queue_write(pipe, m, vec, states, embedder_name, charge)
                replaced = (await pipe.execute())[:len(group)]
            await storage.force_charge(redis, org, sum(charges) - sum(_charge_of(old) for old in replaced))
            await account_write(redis, org, agent)  # the org's agents (memory.store.quotas)


def _charge_of(raw: bytes | str | None) -> int:
    """A stored charge field as a number (0 when absent: stored before budgets, never charged)."""
    try:
        return max(int(raw or 0), 0)
    except ValueError:
        return 0


async def stored_charge(redis: Redis, org_id: str, agent_id: str, memory_id: str) -> int:
    """What the stored memory ``memory_id`` was charged (0 when there is none)."""
    return _charge_of(await redis.hget(memory_key(org_id, agent_id, memory_id), CHARGE_FIELD))


async def write_capped(redis: Redis, item: NewMemory, *, embedder_name: str, embed: EmbedFn,
                       max_per_agent: int, charge: int = 0) -> int:
    """Store one memory unless it would be the agent's ``max_per_agent + 1``-th; returns what the
    memory it replaced was charged (0 for a new one), for the caller to credit back.

    The count check and the write are one optimistic transaction (WATCH on the agent's id set
    and the memory's key), so concurrent writers cannot overshoot the cap, and the charge read is
    the one replaced. ``AgentFull`` if full; rewriting an existing ``memory_id`` never counts as a
    new memory. ``charge`` is stored with the memory (``CHARGE_FIELD``).
    """
    got = split_embedded(await embed([item.record.content]))
    vec, states = got.vectors[0], got.states[0]
    mkey = memory_ids_key(item.org_id, item.agent_id)
    key = memory_key(item.org_id, item.agent_id, item.record.memory_id)
    async with redis.pipeline(transaction=True) as pipe:
        for _ in range(_WATCH_ATTEMPTS):
            try:
                await pipe.watch(mkey, key)
                count = int(await pipe.scard(mkey))
                exists = bool(await pipe.sismember(mkey, item.record.memory_id))
                replaced = _charge_of(await pipe.hget(key, CHARGE_FIELD))
                if not exists and count >= max_per_agent:
                    raise AgentFull(count, max_per_agent)
                pipe.multi()  # type: ignore[no-untyped-call]
                _queue_write(pipe, item, vec, states, embedder_name, charge)
                await pipe.execute()
                return replaced
            except WatchError:
                continue
            finally:
                await pipe.reset()  # type: ignore[no-untyped-call]
    raise WriteContention(f"{mkey} changed under {_WATCH_ATTEMPTS} attempts to write")


@lru_cache(maxsize=16384)
def _validated(raw: bytes | str) -> MemoryRecord:
    """Records are frozen and their bytes are their identity: a record read again (every hot list,
    every repeated search) is validated once. Invalid bytes raise and are not cached."""
    return MemoryRecord.model_validate_json(raw)


T = TypeVar("T")


def per_record(fn: Callable[[MemoryRecord], T]) -> Callable[[MemoryRecord], T]:
    """Memoise ``fn`` per record object, by identity (the entry keeps the record alive, so its id
    cannot be reused): a read returns the same record objects while their bytes are the same
    (``_validated``), and hashing a pydantic model field by field would cost more than ``fn``.

    Records over ``_MEMO_MAX_CHARS`` of content are not memoised (nor kept alive): 16,384 entries of
    64,000-character memories would hold a gigabyte, and for those ``fn`` is cheap next to sending them.
    """
    cache: dict[int, tuple[MemoryRecord, T]] = {}

    def wrapper(rec: MemoryRecord) -> T:
        entry = cache.get(id(rec))
        if entry is not None and entry[0] is rec:
            return entry[1]
        value = fn(rec)
        if len(rec.content) <= _MEMO_MAX_CHARS:
            if len(cache) >= 16384:
                cache.clear()
            cache[id(rec)] = (rec, value)
        return value

    return wrapper


_MEMO_MAX_CHARS = 4_000


def parse_record(raw: bytes | str | None, where: str, health: RecordHealth | None = None,
                 memory_id: str | None = None) -> MemoryRecord | None:
    """A stored record, or ``None`` if the bytes at ``where`` are damaged or out of range.

    A skipped record is logged and counted in ``health``; ``memory_id`` (when given) must match
    the record's own id.
    """
    if raw is None:
        return None
    try:
        rec = _validated(raw)
    except ValidationError as exc:
        err = first_error(exc, root="record")
        reason = f"{err.field}: {err.message}"
        if health is not None:
            health.skip(where, reason)
        else:
            log.warning("skipping memory record at %s: %s", where, reason)
        return None
    if memory_id is not None and rec.memory_id != memory_id:
        if health is not None:
            health.skip(where, f"record says memory_id {rec.memory_id!r}")
        return None
    return rec


def parse_records(raws: Mapping[str, bytes | None], prefix: str, health: RecordHealth | None = None
                  ) -> dict[str, MemoryRecord]:
    """memory id -> its record for each of ``raws`` (the bytes at ``prefix`` + id) that validates and
    carries that id: ``parse_record`` over a search's candidates, its key named only for a skip."""
    out: dict[str, MemoryRecord] = {}
    for mid, raw in raws.items():
        if raw is None:
            continue
        try:
            rec = _validated(raw)
        except ValidationError:
            got = parse_record(raw, f"{prefix}{mid}", health, memory_id=mid)  # logs and counts the skip
            if got is not None:
                out[mid] = got
            continue
        if rec.memory_id == mid:
            out[mid] = rec
        elif health is not None:
            health.skip(f"{prefix}{mid}", f"record says memory_id {rec.memory_id!r}")
    return out


async def store_vectors(redis: Redis, org_id: str, agent_id: str, vectors: dict[str, Vectors],
                        embedder_name: str) -> None:
    """Add this embedder's vectors to memories that lack them (written by hand, or seeded with
    another embedder); a memory deleted meanwhile is not brought back as a vector-only hash."""
    field = vector_field(embedder_name)
    async with redis.pipeline(transaction=False) as pipe:
        for mid, vec in vectors.items():
            key = memory_key(org_id, agent_id, mid)
            pipe.eval(_SET_IF_EXISTS, 1, key, field, np.asarray(vec, dtype=np.float32).tobytes())
        await pipe.execute()


_SET_IF_EXISTS = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end"


