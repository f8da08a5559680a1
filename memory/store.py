"""Redis I/O of the memory service; every key comes from ``shared.keys`` (org first).

Per (org, agent), written together in one MULTI so readers never see half a memory:

    {org}:memories:{agent}                  HASH  memory_id -> MemoryRecord JSON
    {org}:memory_terms:{agent}              HASH  memory_id -> full-text terms, space-joined
    {org}:memory_vectors:{agent}:{embedder} HASH  memory_id -> float32 unit vector
    {org}:hot_memories:{agent}              ZSET  memory_id -> salience (only memories marked hot)
    {org}:memory_rev:{agent}                STRING random token, replaced by every write

Search needs every vector and term set of the agent, and decoding hundreds of RESP strings costs
milliseconds in redis-py's pure-Python parser, so ``IndexCache`` keeps the decoded index per
agent, tagged with the revision token and the record count it was built from; a search pays
one small round trip to check the tag. (Records written to Redis by hand, bypassing this module,
are noticed through the record count only.)

Vectors are per embedder; a search that finds records without a vector for the current embedder
(seeded with another embedder, or written straight to Redis) computes and stores them once.

Reads are total: a record that no longer validates (written straight to Redis, or by an older
version with looser rules) is left out of every answer, logged and counted in ``RecordHealth``
(shown by ``/healthz``), never an error for the agent (README, "Degradation and security").
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeVar, cast

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from ibex_context.memory.embed import Vectors, content_terms
from ibex_context.memory.models import MemoryRecord
from ibex_context.shared.keys import hot_key, memories_key, rev_key, terms_key, vectors_key
from ibex_context.shared.validation import first_error

log = logging.getLogger(__name__)

EmbedFn = Callable[[Sequence[str]], Awaitable[Vectors]]
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


@dataclass(frozen=True, slots=True)
class SearchIndex:
    """What retrieval needs before hydration: ids, their vectors (rows) and their terms.

    ``id_array`` and ``postings`` (term -> rows holding it) let a search score every row with
    array operations (``rank.keyword_mask``, ``rank.select_rows``), built once per index revision.
    """

    ids: list[str]
    matrix: Vectors
    terms: dict[str, frozenset[str]]
    id_array: NDArray[np.str_] = field(default_factory=lambda: np.zeros(0, dtype=np.str_))
    postings: dict[str, NDArray[np.int64]] = field(default_factory=dict)


def build_postings(ids: Sequence[str], terms: dict[str, frozenset[str]]) -> dict[str, NDArray[np.int64]]:
    """Term -> the rows (positions in ``ids``) whose memory holds it."""
    rows_of: dict[str, list[int]] = {}
    for row, mid in enumerate(ids):
        for term in terms.get(mid, ()):
            rows_of.setdefault(term, []).append(row)
    return {t: np.asarray(r, dtype=np.int64) for t, r in rows_of.items()}


@lru_cache(maxsize=65536)
def _terms_of(joined: bytes) -> frozenset[str]:
    return frozenset(joined.decode("utf-8", "replace").split())


def _joined_terms(text: str) -> str:
    return " ".join(sorted(content_terms(text)))


def _queue_write(pipe: Pipeline, m: NewMemory, vec: Vectors, embedder_name: str) -> None:
    """Queue one memory's record, terms, vector and hot flag on a pipeline."""
    rec = m.record
    pipe.hset(memories_key(m.org_id, m.agent_id), rec.memory_id, rec.model_dump_json())
    pipe.hset(terms_key(m.org_id, m.agent_id), rec.memory_id, _joined_terms(rec.content))
    pipe.hset(vectors_key(m.org_id, m.agent_id, embedder_name), rec.memory_id,
              np.asarray(vec, dtype=np.float32).tobytes())
    if m.hot:
        pipe.zadd(hot_key(m.org_id, m.agent_id), {rec.memory_id: rec.salience})
    else:
        pipe.zrem(hot_key(m.org_id, m.agent_id), rec.memory_id)


async def write_memories(redis: Redis, items: Sequence[NewMemory], *, embedder_name: str, embed: EmbedFn) -> None:
    """Store memories (record, terms, vector, hot flag) in chunks of MULTI/EXEC transactions."""
    for start in range(0, len(items), _WRITE_CHUNK):
        chunk = items[start : start + _WRITE_CHUNK]
        vectors = await embed([m.record.content for m in chunk])
        async with redis.pipeline(transaction=True) as pipe:
            for org_id, agent_id in {(m.org_id, m.agent_id) for m in chunk}:
                pipe.set(rev_key(org_id, agent_id), uuid.uuid4().hex)
            for m, vec in zip(chunk, vectors, strict=True):
                _queue_write(pipe, m, vec, embedder_name)
            await pipe.execute()


async def write_capped(redis: Redis, item: NewMemory, *, embedder_name: str, embed: EmbedFn,
                       max_per_agent: int) -> None:
    """Store one memory unless it would be the agent's ``max_per_agent + 1``-th.

    The count check and the write are one optimistic transaction (WATCH on the agent's records),
    so concurrent writers cannot overshoot the cap. ``AgentFull`` if full; rewriting an existing
    ``memory_id`` never counts as a new memory.
    """
    [vec] = await embed([item.record.content])
    mkey = memories_key(item.org_id, item.agent_id)
    async with redis.pipeline(transaction=True) as pipe:
        for _ in range(_WATCH_ATTEMPTS):
            try:
                await pipe.watch(mkey)
                count = int(await pipe.hlen(mkey))
                exists = bool(await pipe.hexists(mkey, item.record.memory_id))
                if not exists and count >= max_per_agent:
                    raise AgentFull(count, max_per_agent)
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.set(rev_key(item.org_id, item.agent_id), uuid.uuid4().hex)
                _queue_write(pipe, item, vec, embedder_name)
                await pipe.execute()
                return
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


async def hydrate(redis: Redis, org_id: str, agent_id: str, ids: Sequence[str],
                  health: RecordHealth | None = None) -> dict[str, MemoryRecord]:
    """Load full records for ``ids``; missing or damaged ones are left out."""
    if not ids:
        return {}
    key = memories_key(org_id, agent_id)
    return parse_records(ids, await redis.hmget(key, list(ids)), key, health)


def parse_records(ids: Sequence[str], raws: Sequence[bytes | str | None], key: str,
                  health: RecordHealth | None = None) -> dict[str, MemoryRecord]:
    """The records of ``ids`` read from hash ``key`` (``raws`` in the same order), keyed by id;
    missing or damaged ones are left out (and counted in ``health``)."""
    out: dict[str, MemoryRecord] = {}
    for mid, raw in zip(ids, raws, strict=True):
        rec = parse_record(raw, f"{key}/{mid}", health, memory_id=mid)
        if rec is not None:
            out[mid] = rec
    return out


IndexTag = tuple[bytes | None, int]
# Above this many memories the index is read in HSCAN pages: one HGETALL of 100,000 384-float
# vectors (150 MB) outlasts the Redis timeout and would fail every time. The tag is read first, so
# a write during the scan only makes the next search rebuild.
SCAN_ABOVE = 20_000
_SCAN_PAGE = 2_000


async def _scan_all(redis: Redis, key: str) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    cursor = 0
    while True:
        cursor, page = await redis.hscan(key, cursor, count=_SCAN_PAGE)
        out.update(cast(dict[bytes, bytes], page))
        if cursor == 0:
            return out


class IndexCache:
    """Decoded search indexes per (org, agent, embedder), least recently used evicted."""

    def __init__(self, max_agents: int = 256) -> None:
        self._max = max_agents
        self._entries: OrderedDict[tuple[str, str, str], tuple[IndexTag, SearchIndex]] = OrderedDict()

    def get(self, key: tuple[str, str, str], tag: IndexTag) -> SearchIndex | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] != tag:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def peek(self, key: tuple[str, str, str]) -> tuple[IndexTag, SearchIndex] | None:
        """The cached index and the tag it was built at, current or not (``memory.reads``)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[str, str, str], tag: IndexTag, index: SearchIndex) -> None:
        self._entries[key] = (tag, index)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


async def load_index(
    redis: Redis, org_id: str, agent_id: str, *, embedder_name: str, dim: int, embed: EmbedFn,
    cache: IndexCache | None = None, health: RecordHealth | None = None,
) -> SearchIndex:
    """Vectors and terms of every memory of the agent, backfilling any that are missing."""
    vkey, tkey, mkey, rkey = (vectors_key(org_id, agent_id, embedder_name), terms_key(org_id, agent_id),
                              memories_key(org_id, agent_id), rev_key(org_id, agent_id))
    cache_key = (org_id, agent_id, embedder_name)
    scanned = False
    if cache is not None:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.get(rkey)
            pipe.hlen(mkey)
            rev, count = await pipe.execute()
        cached = cache.get(cache_key, (rev, count))
        if cached is not None:
            return cached
        if count > SCAN_ABOVE:
            vectors, terms = await _scan_all(redis, vkey), await _scan_all(redis, tkey)
            scanned = True
    if not scanned:
        # One MULTI: the tag is read atomically with the data it describes.
        async with redis.pipeline(transaction=True) as pipe:
            pipe.get(rkey)
            pipe.hlen(mkey)
            pipe.hgetall(vkey)
            pipe.hgetall(tkey)
            rev, count, vectors, terms = await pipe.execute()
    row_bytes = dim * 4
    if len(vectors) < count or len(terms) < count:
        await _backfill(redis, org_id, agent_id, vectors, terms, embedder_name=embedder_name, embed=embed,
                        health=health)
    ids: list[str] = []
    rows: list[bytes] = []
    term_map: dict[str, frozenset[str]] = {}
    for raw_id, joined in terms.items():
        term_map[raw_id.decode()] = _terms_of(joined)
    for raw_id, vec in vectors.items():
        if len(vec) == row_bytes:
            ids.append(raw_id.decode())
            rows.append(vec)
    matrix = (np.frombuffer(b"".join(rows), dtype=np.float32).reshape(len(rows), dim) if rows
              else np.zeros((0, dim), dtype=np.float32))
    index = SearchIndex(ids=ids, matrix=matrix, terms=term_map, id_array=np.asarray(ids, dtype=np.str_),
                        postings=build_postings(ids, term_map))
    if cache is not None:
        cache.put(cache_key, (rev, count), index)
    return index


async def _backfill(
    redis: Redis, org_id: str, agent_id: str, vectors: dict[bytes, bytes], terms: dict[bytes, bytes],
    *, embedder_name: str, embed: EmbedFn, health: RecordHealth | None = None,
) -> None:
    """Compute vectors/terms for records that lack them (mutates the two dicts in place)."""
    mkey = memories_key(org_id, agent_id)
    all_ids = [m if isinstance(m, bytes) else m.encode() for m in await redis.hkeys(mkey)]
    missing = [m for m in all_ids if m not in vectors or m not in terms]
    if not missing:
        return
    raws = await redis.hmget(mkey, missing)
    fixed: list[tuple[bytes, MemoryRecord]] = []
    for mid, raw in zip(missing, raws, strict=True):
        rec = parse_record(raw, f"{mkey}/{mid.decode(errors='replace')}", health)
        if rec is not None:
            fixed.append((mid, rec))
    if not fixed:
        return
    new_vecs = await embed([rec.content for _, rec in fixed])
    vmap = {mid: np.asarray(v, dtype=np.float32).tobytes() for (mid, _), v in zip(fixed, new_vecs, strict=True)}
    tmap = {mid: _joined_terms(rec.content).encode() for mid, rec in fixed}
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(vectors_key(org_id, agent_id, embedder_name), mapping=vmap)  # type: ignore[arg-type]
        pipe.hset(terms_key(org_id, agent_id), mapping=tmap)  # type: ignore[arg-type]
        await pipe.execute()
    vectors.update(vmap)
    terms.update(tmap)
    log.info("backfilled %d vectors/terms for %s (embedder %s)", len(fixed), mkey, embedder_name)
