"""The memory indexes on the Redis Query Engine (RediSearch): schema, creation, and the two queries
of a hybrid search (docs/memory-search.md).

One index per org and embedder covers the org's memory hashes (key prefix ``mem:{org:``); on a
Redis Cluster one index per agent and embedder, named with the agent's hash tag, covers the
agent's (``shared.stores.keys.memory_index`` says why):

    org         TAG  CASESENSITIVE     the tenant: the vector query filters on org and agent
    agent       TAG  CASESENSITIVE
    tenant      NUMERIC                a 52-bit hash of (org, agent): the full-text query's filter
    content     TEXT                   BM25 (the engine's Okapi BM25STD scorer), English stemming
    created_at  NUMERIC SORTABLE       epoch seconds
    v_{embedder} VECTOR HNSW FLOAT32 COSINE, the embedder's dimension

The engine indexes every write as it happens: a memory written is found by the next search, and
no process keeps a copy of the index. Tags are case-sensitive because identifiers are: ``Acme``
and ``acme`` are two tenants.

Why an index per org: BM25 weighs a word by how many documents of the index hold it. In one index
shared by every tenant, the scores one org sees would depend on (and so reveal) how often words
occur in other orgs' memories. Per org, the statistics are the org's own; every query still
filters on org and agent inside the engine. The HNSW graphs are per org too, so a vector search
walks only the org's memories.

The full-text side is one query per question word (tenant filter AND word), sent together (a
large agent's common words score only the candidates instead: ``memory.search.terms``): each
reply gives that word's BM25 matches and how many of the agent's memories hold it, which the
fusion weighs (``memory.search.fusion``). (One ``filter (a|b)`` query would not do: the engine scores a
union nested inside an intersection by its first matching word only.) Its tenant filter is the
numeric ``tenant`` field because the engine scores TAG matches as words (weighted by the agent's
share of the org and the memory's length), which would bend BM25; a numeric range adds nothing.
Every hit's key must also carry the agent's own prefix
(``parse_reply``), so even two agents whose hashes collided could not see each other's memories.

The queries are sent as raw ``FT.SEARCH`` commands on one pipeline (one round trip for both
halves) and their replies parsed here: redis-py's ``ft().search()`` builds a ``Document`` per hit
and cannot share a round trip, and ``redisvl`` adds a schema layer this one index does not need.
``ensure_index`` uses the same raw commands, so the module runs on any redis-py that speaks RESP3.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ...shared.stores.connect import is_cluster
from ...shared.stores.keys import check_ident, memory_index, vector_field
from ..embedders.embed import STOPWORDS, normalize

# HNSW graph parameters: the engine's defaults (M 16, EF_CONSTRUCTION 200), named so a reader
# sees them; EF_RUNTIME is raised per query to the number of neighbours asked for.
HNSW_M = 16
HNSW_EF_CONSTRUCTION = 200
# An index per agent (a cluster) reserves room for this many vectors when created (empty: ~36 KB
# against ~54 KB with the engine's default). Its first write still allocates a whole vector block:
# ~1.7 MB per agent index at 256 dimensions, measured with 20 memories each (``python -m
# bench.index_layout``); this build's HNSW refuses a smaller BLOCK_SIZE.
AGENT_INDEX_BLOCK = 64
MAX_QUERY_TERMS = 16  # a question's distinct content words searched: each is one engine query
_MAX_TERM_CHARS = 48
_WORD = re.compile(r"\w+", re.UNICODE)
# Everything but ASCII letters and digits is escaped in a query: tags, words and parameters alike.
_UNSAFE = re.compile(r"[^A-Za-z0-9]")


class QueryEngineMissing(RuntimeError):
    """The Redis server has no query engine (``FT.*`` commands); the memory service needs one."""


def index_name(embedder: str, org_id: str, agent_id: str, *, per_agent: bool = False) -> str:
    """The index ``agent_id``'s memories are searched in (per org; ``per_agent`` on a cluster)."""
    return memory_index(embedder, org_id, agent_id, per_agent=per_agent)[0]


def per_agent_indexes(redis: object) -> bool:
    """True when ``redis`` is a cluster client: indexes per agent (``shared.stores.keys.memory_index``)."""
    return is_cluster(redis)


def _escape(text: str) -> str:
    return _UNSAFE.sub(lambda m: "\\" + m.group(), text)


def tenant_number(org_id: str, agent_id: str) -> int:
    """The agent's ``tenant`` field: 52 bits of BLAKE2b of ``org:agent`` (exact in a double)."""
    key = f"{check_ident(org_id, 'org_id')}:{check_ident(agent_id, 'agent_id')}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & ((1 << 52) - 1)


def tenant_filter(org_id: str, agent_id: str) -> str:
    """The query clause that confines a search to one org's agent (checked identifiers, escaped)."""
    return f"@org:{{{_escape(check_ident(org_id, 'org_id'))}}} @agent:{{{_escape(check_ident(agent_id, 'agent_id'))}}}"


def query_terms(text: str) -> list[str]:
    """The distinct content words of a question, in order, as full-text terms.

    Stop words are dropped here (the engine would also drop its own); stemming is the engine's.
    Words are cut at ``_MAX_TERM_CHARS`` (a clause of CJK text is one ``\\w+`` run) and at most
    ``MAX_QUERY_TERMS`` are kept.
    """
    seen: dict[str, None] = {}
    for word in _WORD.findall(normalize(text)):
        word = word[:_MAX_TERM_CHARS]
        if word in STOPWORDS or word in seen or (len(word) < 2 and word.isascii()):
            continue
        seen[word] = None
        if len(seen) >= MAX_QUERY_TERMS:
            break
    return list(seen)


def tenant_query(org_id: str, agent_id: str) -> str:
    """Every memory of one org's agent (with ``INKEYS``: the named ones among them)."""
    n = tenant_number(org_id, agent_id)
    return f"@tenant:[{n} {n}]"


def word_query(org_id: str, agent_id: str, word: str) -> str:
    """Full-text query for one word in ``content``, inside the tenant filter."""
    n = tenant_number(org_id, agent_id)
    return f"@tenant:[{n} {n}] @content:{_escape(word)}"


def total_results(reply: Any) -> int:
    """How many documents an ``FT.SEARCH`` matched (RESP3 map or RESP2 list)."""
    if isinstance(reply, Mapping):
        return int(reply.get(b"total_results", reply.get("total_results", 0)))
    return int(reply[0]) if reply else 0


def knn_query(org_id: str, agent_id: str, field: str, k: int, *, exact: bool) -> str:
    """Vector query: the ``k`` nearest of the agent's memories, inside the tenant filter.

    ``exact`` (an agent with at most ``IBEX_MEMORY_EXACT_KNN_MAX`` memories) compares the question with every
    memory of the agent (``ADHOC_BF``): exact, and cheap at that size. Above it the engine walks the
    HNSW graph in batches and keeps the agent's hits (``BATCHES``): approximate, but its cost does
    not grow with the agent (at 100,000 memories of 256 dimensions, 2.4 ms against 47 ms for the
    brute force the engine picks by itself when the agent is most of the org: docs/memory-search.md).
    """
    policy = "HYBRID_POLICY ADHOC_BF" if exact else f"HYBRID_POLICY BATCHES EF_RUNTIME {max(int(k), 10)}"
    return f"({tenant_filter(org_id, agent_id)})=>[KNN {int(k)} @{field} $vec {policy} AS vd]"


def missing_index(exc: ResponseError) -> bool:
    """True for the engine's error about an index that does not exist (dropped by FLUSHALL)."""
    text = str(exc).lower()
    return "no such index" in text or "unknown index" in text or "index not found" in text


def _engine_missing(exc: ResponseError) -> QueryEngineMissing | None:
    if "unknown command" not in str(exc).lower():
        return None
    return QueryEngineMissing("this Redis has no query engine (FT.* commands are unknown): point IBEX_REDIS_URL at "
                              "Redis 8 or Redis Stack, or leave it unset to use the bundled server")


async def check_engine(redis: Redis) -> None:
    """``QueryEngineMissing`` unless the server answers the query engine's commands."""
    try:
        await redis.execute_command("FT._LIST")  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        missing = _engine_missing(exc)
        if missing is not None:
            raise missing from exc
        raise


def create_args(embedder: str, dim: int, org_id: str, agent_id: str, *, per_agent: bool) -> list[str]:
    """The arguments of the ``FT.CREATE`` of the agent's index (its name first): the schema above."""
    name, prefix = memory_index(embedder, org_id, agent_id, per_agent=per_agent)
    hnsw = ["TYPE", "FLOAT32", "DIM", str(dim), "DISTANCE_METRIC", "COSINE", "M", str(HNSW_M),
            "EF_CONSTRUCTION", str(HNSW_EF_CONSTRUCTION)]
    if per_agent:  # many small indexes: room for few vectors at first, not the engine's default
        hnsw += ["INITIAL_CAP", str(AGENT_INDEX_BLOCK)]
    return [name, "ON", "HASH", "PREFIX", "1", prefix, "SCHEMA",
            "org", "TAG", "CASESENSITIVE", "agent", "TAG", "CASESENSITIVE", "tenant", "NUMERIC",
            "content", "TEXT", "created_at", "NUMERIC", "SORTABLE",
            vector_field(embedder), "VECTOR", "HNSW", str(len(hnsw)), *hnsw]


async def ensure_index(redis: Redis, embedder: str, dim: int, org_id: str, agent_id: str, *,
                       wait_s: float = 5.0, per_agent: bool | None = None) -> None:
    """Create the index of the agent's memories for the embedder if it does not exist (idempotent,
    safe to race), and wait up to ``wait_s`` for the engine to index the memories already stored
    (it does so in the background). The index is the org's on one server, the agent's on a cluster
    (``per_agent`` overrides the choice: the layout bench compares both on one server).

    ``QueryEngineMissing`` when the server has no ``FT.CREATE``; ``RuntimeError`` when an index of
    that name exists with another vector size (another build of the embedder).
    """
    per_agent = per_agent_indexes(redis) if per_agent is None else per_agent
    create = create_args(embedder, dim, org_id, agent_id, per_agent=per_agent)
    name, field = create[0], vector_field(embedder)
    try:
        info = await redis.execute_command("FT.INFO", name)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        missing = _engine_missing(exc)
        if missing is not None:
            raise missing from exc
        if not missing_index(exc):
            raise
        info = None
    if info is not None:
        _check_dim(info, field, dim, name)
        return
    try:
        await redis.execute_command("FT.CREATE", *create)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        if "already exists" not in str(exc).lower():
            raise
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        info_map = _as_map(await redis.execute_command("FT.INFO", name))  # type: ignore[no-untyped-call]
        if not int(float(_text(info_map.get("indexing", 0)))):
            return
        await asyncio.sleep(0.01)


def _check_dim(info: Any, field: str, dim: int, name: str) -> None:
    """Refuse an existing index whose vector field has another dimension than the embedder's."""
    info_map = _as_map(info)
    for attr in info_map.get("attributes", []):
        a = _as_map(attr)
        if _text(a.get("identifier")) == field:
            found = a.get("dim")
            if found is not None and int(_text(found)) != dim:
                raise RuntimeError(f"index {name} has {field} of dimension {_text(found)}, the embedder gives {dim}: "
                                   f"drop it (FT.DROPINDEX {name}) to rebuild")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _as_map(v: Any) -> dict[str, Any]:
    """A RESP3 map or a RESP2 flat list as a dict with str keys."""
    if isinstance(v, Mapping):
        return {_text(k): val for k, val in v.items()}
    if isinstance(v, list):
        return {_text(v[i]): v[i + 1] for i in range(0, len(v) - 1, 2)}
    return {}


@dataclass(frozen=True, slots=True)
class Found:
    """One memory a query returned: its id, the engine's score, and the fields asked for."""

    memory_id: str
    score: float  # BM25 for the text query; cosine similarity for the vector query
    record: bytes | None
    vector: bytes | None
    states: bytes | None = None  # the memory's token states, when the query returned them


def parse_reply(reply: Any, prefix: str, vfield: str, *, vector_query: bool, sfield: str = "") -> list[Found]:
    """The hits of an ``FT.SEARCH`` reply (RESP3 map or RESP2 list) whose key has ``prefix``.

    The prefix check is a second tenant guard: the tenant filter already confines the query, and
    a key of another agent is dropped here even if it were returned.
    """
    out: list[Found] = []
    bprefix, bvfield, bsfield, n = prefix.encode(), vfield.encode(), sfield.encode(), len(prefix)
    for key, score, fields in _rows(reply):
        if not key.startswith(bprefix):
            continue
        if vector_query:
            raw = fields.get(b"vd")
            try:
                score = 1.0 - float(raw) if raw is not None else 0.0  # COSINE distance is 1 - cosine
            except ValueError:
                score = 0.0
        rec, vec, states = fields.get(b"rec"), fields.get(bvfield), fields.get(bsfield) if bsfield else None
        out.append(Found(key[n:].decode(), score if math.isfinite(score) else 0.0,
                         rec if isinstance(rec, bytes) else None, vec if isinstance(vec, bytes) else None,
                         states if isinstance(states, bytes) else None))
    return out


def scored_ids(reply: Any, prefix: str) -> dict[str, float]:
    """memory id -> the engine's score for each hit of a ``NOCONTENT WITHSCORES`` reply whose key
    has ``prefix`` (a full-text word query): RESP3's map, or RESP2's ``[total, key, score, ...]``."""
    bprefix = prefix.encode()
    n, isfinite = len(bprefix), math.isfinite
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(reply, Mapping):
        pairs = ((h[b"id"], h.get(b"score", 0.0)) for h in reply.get(b"results", ()))
    else:
        it = iter(reply or ())
        next(it, None)  # the total
        pairs = zip(it, it, strict=False)
    out: dict[str, float] = {}
    for key, raw in pairs:
        if key.startswith(bprefix):
            score = float(raw or 0.0)
            out[key[n:].decode()] = score if isfinite(score) else 0.0
    return out


Nearest = tuple[dict[str, float], dict[str, bytes | None], dict[str, bytes | None]]


def fields_of(reply: Any, prefix: str, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
    """memory id -> the values of ``fields`` (``None`` where absent) for each hit of a reply that
    returned them, whose key has ``prefix``."""
    bprefix, bfields = prefix.encode(), [f.encode() for f in fields]
    n = len(bprefix)
    out: dict[str, list[bytes | None]] = {}
    for key, _, got in _rows(reply):
        if key.startswith(bprefix):
            out[key[n:].decode()] = [v if isinstance(v := got.get(f), bytes) else None for f in bfields]
    return out


def nearest(reply: Any, prefix: str, sfield: str = "") -> Nearest:
    """A KNN reply (``vd`` and ``rec``, with an ``sfield`` its token states too) as memory id ->
    cosine, -> record bytes and -> token states, for the hits whose key has ``prefix``; the same
    as ``parse_reply(..., vector_query=True)`` read into three maps in one pass."""
    cosine: dict[str, float] = {}
    recs: dict[str, bytes | None] = {}
    states: dict[str, bytes | None] = {}
    bprefix, bsfield = prefix.encode(), sfield.encode()
    n, isfinite = len(bprefix), math.isfinite
    for key, raw, rec, st in _nearest_rows(reply, bsfield):
        if not key.startswith(bprefix):
            continue
        mid = key[n:].decode()
        try:
            score = 1.0 - float(raw) if raw is not None else 0.0  # COSINE distance is 1 - cosine
        except ValueError:
            score = 0.0
        cosine[mid] = score if isfinite(score) else 0.0
        recs[mid] = rec if rec.__class__ is bytes else None
        if bsfield:
            states[mid] = st if st.__class__ is bytes else None
    return cosine, recs, states


def _nearest_rows(reply: Any, bsfield: bytes) -> Iterator[tuple[bytes, Any, Any, Any]]:
    """(key, ``vd``, ``rec``, token states) per row of a KNN reply; a RESP2 row holding the fields
    in the order asked (all of them, as the engine returns them) is read by position, not mapped."""
    if isinstance(reply, Mapping):
        empty: dict[bytes, Any] = {}
        for h in reply.get(b"results", ()):
            fields = h.get(b"extra_attributes") or empty
            yield h[b"id"], fields.get(b"vd"), fields.get(b"rec"), fields.get(bsfield) if bsfield else None
        return
    if not (isinstance(reply, list) and len(reply) % 2 and all(f.__class__ is list for f in reply[2::2])):
        for key, _, fields in _rows(reply):
            yield key, fields.get(b"vd"), fields.get(b"rec"), fields.get(bsfield) if bsfield else None
        return
    width = 6 if bsfield else 4
    it = iter(reply)
    next(it, None)  # the total
    for key, flat in zip(it, it, strict=False):
        if len(flat) == width and flat[0] == b"vd" and flat[2] == b"rec" and (not bsfield or flat[4] == bsfield):
            yield key, flat[1], flat[3], flat[5] if bsfield else None
        else:
            fields = dict(zip(flat[::2], flat[1::2], strict=False))
            yield key, fields.get(b"vd"), fields.get(b"rec"), fields.get(bsfield) if bsfield else None


def _rows(reply: Any) -> list[tuple[bytes, float, dict[bytes, Any]]]:
    """(key, score, fields) per hit of a WITHSCORES-or-not FT.SEARCH reply that returned fields
    (bytes, not decoded)."""
    if isinstance(reply, Mapping):  # RESP3
        return [(h[b"id"], float(h.get(b"score", 0.0) or 0.0), h.get(b"extra_attributes") or {})
                for h in reply.get(b"results", ())]
    # RESP2 (the search's client): [total, id, (score,) [field, value, ...], id, ...]
    items = list(reply)[1:]
    fields = items[1::2]
    if len(fields) * 2 == len(items) and all(f.__class__ is list for f in fields):  # no scores: one pass
        return [(key, 0.0, dict(zip(f[::2], f[1::2], strict=False))) for key, f in zip(items[::2], fields, strict=True)]
    # a score follows an id when the entry after it is not a list.
    rows: list[tuple[bytes, float, dict[bytes, Any]]] = []
    i = 0
    while i < len(items):
        key, score = items[i], 0.0
        i += 1
        if i < len(items) and not isinstance(items[i], list):
            score = float(items[i])
            i += 1
        flat = items[i] if i < len(items) and isinstance(items[i], list) else []
        i += 1
        rows.append((key, score, {flat[j]: flat[j + 1] for j in range(0, len(flat) - 1, 2)}))
    return rows


def search_args(query: str, *, limit: int, returns: Sequence[str], scored: bool,
                params: Mapping[str, bytes] | None = None, sort_by: str | None = None,
                in_keys: Sequence[str] = ()) -> list[Any]:
    """The argument list of one ``FT.SEARCH`` (dialect 2); ``in_keys``: only these documents."""
    args: list[Any] = [query]
    if in_keys:
        args += ["INKEYS", str(len(in_keys)), *in_keys]
    if scored:
        args += ["SCORER", "BM25STD", "WITHSCORES"]
    args += ["RETURN", str(len(returns)), *returns] if returns else ["NOCONTENT"]
    if sort_by is not None:
        args += ["SORTBY", sort_by]
    if params:
        args += ["PARAMS", str(2 * len(params))]
        for k, v in params.items():
            args += [k, v]
    args += ["LIMIT", "0", str(int(limit)), "DIALECT", "2"]
    return args
