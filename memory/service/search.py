"""Search and hot ranking of the memory service (the handlers in ``memory.service.app`` call these).

Search (docs/memory-search.md): the query is embedded once (``MemoryService.query_vector``); the
Redis Query Engine answers a BM25 full-text query and a KNN vector query over the agent's
memories, both filtered to the tenant inside the engine, in one round trip that also returns the
candidates' records; ``memory.search.fusion`` turns each candidate's two scores into one relevance, and
the five-part composite (spec "Memory-service composite") ranks them.

Hot with a query: the hot list (the ``limit`` most salient) is ranked for the question instead of
by salience alone: each hit's relevance is ``rank.hot_relevance`` (cosine with the question and
salience) and the list is ordered by the composite, as search results are. Every hit carries
``relevance``, ``composite`` and its ``components``; hot hits also carry ``salience``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Any

import numpy as np
from redis.exceptions import ResponseError
from starlette.responses import JSONResponse, Response

from ...shared.stores.keys import memory_ids_key, memory_key_prefix, states_field, vector_field
from ..embedders.embed import Vectors
from ..search.cutoff import cosine_reason, cut
from ..search.fulltext import FullText, Scope
from ..search.fusion import Floats, Fused, Pool, boost_pool, fuse_pool
from ..search.index import (
    fields_of,
    knn_query,
    missing_index,
    nearest,
    query_terms,
    search_args,
    tenant_query,
)
from ..search.rank import (
    check_relevance_floor,
    cosine_scores,
    hot_relevance,
    order_of,
    rank_arrays,
    record_features,
)
from ..search.rerank import joined_pool, rerank_pool, stays_pool
from ..search.subjects import first_name, question_words, subject_of
from ..search.terms import SAMPLE_SIZE
from ..store import writes as store
from ..store.records import MemoryRecord
from .deadline import check
from .models import SearchBody
from .state import MemoryService

AGENT_SIZES_KEPT = 65_536  # agents whose memory count a service process remembers (_agent_size)
_query_terms = lru_cache(maxsize=4096)(query_terms)  # repeated questions are parsed once
_question_words = lru_cache(maxsize=4096)(question_words)


@store.per_record
def _features(rec: MemoryRecord) -> tuple[tuple[float, float, float, float, float], float]:
    """The record's ``rank.record_features`` and its access score as the wire shows it."""
    f = record_features(rec.created_at.timestamp(), rec.category, rec.usefulness, rec.confidence, rec.access_count)
    return f, round(f[4], 6)


@store.per_record
def _first_name(rec: MemoryRecord) -> str | None:
    """The first name of the person the memory is about (``memory.search.subjects``), folded."""
    subject = subject_of(rec.subject, rec.content)
    return first_name(subject) if subject else None


BELOW_CONTENT_CHARS = 200  # a below-cutoff candidate's content is shown up to this many characters
Below = tuple[MemoryRecord, str, Fused]  # a candidate under the cosine cutoff, why, and its scores


@dataclass(frozen=True, slots=True)
class Stages:
    """A search's per-candidate stage scores, and what it shows under its line (``memory.search.cutoff``)."""

    pool: Pool  # aligned with the ranked records
    below: Sequence[Below]  # the vector candidates under the cosine cutoff, most similar first
    shown: int  # how many candidates under the line are sent


def _stages(f: Fused) -> dict[str, float]:
    """A search hit's stage scores as the wire shows them (docs/memory-search.md); ``rerank_score``
    only for a candidate the late-interaction rerank scored (``memory.search.rerank``)."""
    out = {"text_score": round(f.text, 6), "vector_score": round(f.vector, 6), "boost": round(f.boost, 6)}
    if f.rerank is not None:
        out["rerank_score"] = round(f.rerank, 6)
    return out


def _ranked(svc: MemoryService, where: str, recs: Sequence[MemoryRecord], relevance: Sequence[float] | Floats, *,
            salience: Sequence[float] | None, floor: float, limit: int,
            stages: Stages | None = None) -> Response:
    """Rank ``recs`` by the composite (``rank.rank_arrays``) and answer with each hit's relevance,
    composite and components; hot hits (``salience`` given) also carry their salience, which is
    their ``similarity``; a search hit's similarity is its relevance, and it also carries the
    stage scores its relevance came from (``stages``), and the first ``stages.shown`` candidates
    under the line (``memory.search.cutoff``; then ``stages.below``) are sent beside the answer."""
    rel: list[float] = relevance.tolist() if isinstance(relevance, np.ndarray) else list(relevance)
    order, scores, recencies = rank_arrays([r.memory_id for r in recs], rel, [_features(r)[0] for r in recs],
                                           now_s=svc.clock(), relevance_floor=0.0, limit=len(recs))
    shown = 0 if stages is None else stages.shown
    kept, under = cut(order, rel, floor=check_relevance_floor(floor), limit=limit, shown=shown)
    need = {*kept, *(i for i, _ in under)}  # cut takes them from the front of the order
    at: dict[int, tuple[float, float]] = {}
    for i, s, r in zip(order, scores, recencies, strict=True):
        if i in need:
            at[i] = (s, r)
            if len(at) == len(need):
                break
    found: list[tuple[MemoryRecord, float]] = []
    extras: list[dict[str, Any]] = []
    for i in kept:
        rec, shown_rel, (score, recency) = recs[i], round(rel[i], 6), at[i]
        doc: dict[str, Any] = {"relevance": shown_rel, "composite": round(score, 6), "components": {
            "relevance": shown_rel, "recency": round(recency, 6), "usefulness": rec.usefulness,
            "confidence": rec.confidence, "access": _features(rec)[1]}}
        if salience is not None:
            doc["salience"] = salience[i]
        if stages is not None:
            doc.update(_stages(stages.pool.fused(i)))
        found.append((rec, rel[i] if salience is None else salience[i]))
        extras.append(doc)
    rows = [_below_row(recs[i], why, None if stages is None else stages.pool.fused(i), rel[i], at[i][0])
            for i, why in under]
    if stages is not None:
        rows += [_below_row(rec, why, f, None, None) for rec, why, f in stages.below[: max(shown - len(rows), 0)]]
    return svc.answer(found, where, extras, below=rows)


def _below_row(rec: MemoryRecord, why: str, f: Fused | None, relevance: float | None,
               composite: float | None) -> dict[str, Any]:
    """One candidate under the line as the search sends it (``memory.search.cutoff``)."""
    row: dict[str, Any] = {"memory_id": rec.memory_id, "content": rec.content[:BELOW_CONTENT_CHARS], "reason": why}
    if relevance is not None and composite is not None:
        row["relevance"], row["composite"] = round(relevance, 6), round(composite, 6)
    if f is not None:
        row.update(_stages(f))
    return row


Under = list[tuple[float, str]]  # vector candidates under the cosine cutoff: (cosine, memory id), most similar first


def _fused(svc: MemoryService, question: str, records: dict[str, MemoryRecord], text_of: dict[str, float],
           cosine: dict[str, float], cutoff: float, want: int) -> tuple[Pool, Under]:
    """The candidates retrieval keeps, fused (``memory.search.fusion``) and lifted when about a person the
    question names (``memory.search.subjects``); and the ``want`` most similar vector candidates under the
    cosine cutoff, as (cosine, memory id): some may join the rerank (``rerank.joined_pool``), the others are
    shown under the line when the search has fewer than its line's worth (``_below``)."""
    cfg = svc.config
    ids = [m for m in records if m in cosine or m in text_of]
    n = len(ids)
    has_cos = np.fromiter(map(cosine.__contains__, ids), dtype=np.bool_, count=n)
    cos = np.fromiter(map(cosine.get, ids, repeat(0.0, n)), dtype=np.float64, count=n)
    txt = np.fromiter(map(text_of.get, ids, repeat(0.0, n)), dtype=np.float64, count=n)
    pool, kept = fuse_pool(ids, txt, cos, min_similarity=cutoff, text_weight=cfg.text_weight, rule=cfg.fusion)
    if cfg.subject_boost > 0.0:
        words = _question_words(question)
        about = np.fromiter(map(words.__contains__, map(_first_name, map(records.__getitem__, pool.ids))),
                            dtype=np.bool_, count=len(pool.ids))
        pool = boost_pool(pool, about, cfg.subject_boost)
    out = np.flatnonzero(has_cos & ~kept)
    if want <= 0 or not len(out):
        return pool, []
    out_ids = [ids[i] for i in out.tolist()]
    out_cos = cos[out]
    order = order_of(out_ids, out_cos)[:want].tolist()
    return pool, [(float(out_cos[i]), out_ids[i]) for i in order]


def _below(records: dict[str, MemoryRecord], under: Under, fused: set[str], joined: dict[str, Fused],
           cutoff: float, shown: int) -> list[Below]:
    """The vector candidates under the cosine cutoff that were not kept, most similar first, with why
    (and, for one the rerank scored, its MaxSim and the relevance it left it at)."""
    out: list[Below] = []
    for c, m in under:
        if len(out) >= shown:
            break
        if m in fused:
            continue
        why, f = cosine_reason(c, cutoff), joined.get(m, Fused(0.0, 0.0, min(max(c, 0.0), 1.0)))
        out.append((records[m], why if f.rerank is None else f"{why}; reranked to {f.relevance:.3f}", f))
    return out


async def search(svc: MemoryService, org: str, body: SearchBody, deadline: float | None = None) -> Response:
    """Rank the agent's memories for the query (docs/memory-search.md).

    One round trip asks the engine, inside the tenant filter, for each question word's BM25 matches
    (ids and scores) and how many memories hold it, the nearest vectors with their records, and the
    agent's memory count; a second fetches the records of full-text candidates the vector side did
    not return. ``memory.search.fusion`` scores each candidate, memories about a person the question names
    are lifted, and the composite ranks them; the few just under the line are sent beside the
    answer (``memory.search.cutoff``). Neither the query's embedding nor the engine's search starts after
    ``deadline`` (``memory.service.deadline``).

    The embedding has its own fair queue (``memory.service.querybatch``); a search slot
    (``memory.service.fair_slots``) is for the engine's search and the ranking, so it is taken once
    the vector is known: a slot held through another org's wait for its embedding would keep this
    org's search waiting too.
    """
    text = svc.query_text(body.query)
    query_vec = np.asarray(await svc.query_vector(org, text, deadline), dtype=np.float32)
    async with svc.read_slots.hold(org, deadline):
        check(deadline, "the search")
        started = time.monotonic()
        try:
            return await _searched(svc, org, body, text, query_vec)
        finally:
            svc.note_search(time.monotonic() - started)


async def _searched(svc: MemoryService, org: str, body: SearchBody, text: str, query_vec: Vectors) -> Response:
    """``search`` once the query's vector is known."""
    agent = body.agent_id
    cfg = svc.config
    query_states = svc.query_states(org, text) if cfg.rerank_weight > 0.0 else None
    sfield = states_field(svc.embedder.name) if query_states is not None else ""
    text_of, cosine, raws, states = await _candidates(svc, org, agent, _query_terms(text), query_vec, sfield)
    records = await _hydrate(svc, org, agent, (text_of, cosine, raws, states), query_vec, sfield)
    cutoff = svc.embedder.min_similarity if body.min_similarity is None else body.min_similarity
    want = min(cfg.rerank_min_candidates, cfg.rerank_depth) if query_states is not None else 0
    pool, under = _fused(svc, text, records, text_of, cosine, cutoff, want + cfg.below_cutoff)
    kept = len(pool.ids)
    pool = rerank_pool(joined_pool(pool, under, want), query_states, states, weight=cfg.rerank_weight,
                       depth=cfg.rerank_depth, floor=cfg.relevance_floor)
    joined = {pool.ids[i]: pool.fused(i) for i in range(kept, len(pool.ids))}
    if joined:
        pool = stays_pool(pool, kept, cutoff)
    below = _below(records, under, set(pool.ids), joined, cutoff, cfg.below_cutoff) if under else []
    if not pool.ids and not below:
        return JSONResponse({"memories": []})
    recs = [records[m] for m in pool.ids]
    return _ranked(svc, f"{org}/{agent}", recs, pool.relevance, salience=None,
                   floor=svc.config.relevance_floor, limit=body.limit,
                   stages=Stages(pool, below, svc.config.below_cutoff))


Candidates = tuple[dict[str, float], dict[str, float], dict[str, bytes | None], dict[str, bytes | None]]


async def _candidates(svc: MemoryService, org: str, agent: str, terms: Sequence[str], query_vec: Vectors,
                      sfield: str = "") -> Candidates:
    """The engine's candidates: full-text scores (the best ``max_candidates``), cosines of the
    ``vector_candidates`` nearest vectors, and the records (and, with an ``sfield``, the token states) the vector query
    returned with them. One round trip, and one more when the question has common or new words
    (``memory.search.fulltext``)."""
    k, embedder, now, scan_max = svc.config.max_candidates, svc.embedder, svc.clock(), svc.config.term_scan_max
    kv = svc.config.vector_candidates
    prefix, vfield, name = memory_key_prefix(org, agent), vector_field(embedder.name), svc.index_name(org, agent)
    size = await _agent_size(svc, org, agent)
    sample = await _sample(svc, org, agent, now) if size > scan_max else ()
    scope = Scope(embedder.name, org, agent, svc.per_agent_indexes)
    text = FullText(svc.terms, scope, terms, size=size, sample=sample, scan_max=scan_max, limit=k, now=now)
    commands = text.first()
    commands.append(("FT.SEARCH", name, *search_args(
        knn_query(org, agent, vfield, kv, exact=size <= svc.config.exact_knn_max), limit=kv,
        returns=("vd", "rec", sfield) if sfield else ("vd", "rec"), scored=False,
        params={"vec": query_vec.tobytes()}, sort_by="vd")))
    commands.append(("SCARD", memory_ids_key(org, agent)))
    replies = await _engine(svc, org, agent, commands)
    _remember_size(svc, org, agent, int(replies[-1]))
    text.read_first(replies[:-2], int(replies[-1]))
    cosine, raws, states = nearest(replies[-2], prefix, sfield)
    if text.needs_second:
        pool = text.scores(k).keys() | cosine.keys()
        text.read_second(await _engine(svc, org, agent, text.second(pool)), pool)
    return text.scores(k), cosine, raws, states


async def _sample(svc: MemoryService, org: str, agent: str, now: float) -> tuple[str, ...]:
    """A random sample of the agent's memory ids, drawn again each ``terms.SAMPLE_TTL_S``."""
    got = svc.terms.sample(org, agent, now)
    if got is None:
        raw = await svc.redis.srandmember(memory_ids_key(org, agent), SAMPLE_SIZE)
        got = tuple(sorted(m.decode() if isinstance(m, bytes) else str(m) for m in raw or ()))
        svc.terms.keep_sample(org, agent, got, now)
    return got


async def _engine(svc: MemoryService, org: str, agent: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The commands on one pipeline, the org's index made first; a dropped index (FLUSHALL drops
    every index) is made again, what is stored indexed, and the commands sent once more."""
    await svc.ensure_index(org, agent)
    try:
        return await _run(svc, commands)
    except ResponseError as exc:
        if not missing_index(exc):
            raise
        await svc.ensure_index(org, agent, again=True)
        return await _run(svc, commands)


async def _hydrate(svc: MemoryService, org: str, agent: str, found: Candidates, query_vec: Vectors,
                   sfield: str = "") -> dict[str, MemoryRecord]:
    """Every candidate's parsed record; full-text-only candidates are read (record, vector and,
    with an ``sfield``, token states) in one more round trip and get their cosine added to the
    cosines (embedded now if they have none)."""
    _, cosine, raws, _ = found
    vectors = await _read_missing(svc, org, agent, found, sfield)
    records = store.parse_records(raws, memory_key_prefix(org, agent), svc.health)
    size = svc.embedder.dim * 4
    read = [(mid, vec) for mid, vec in vectors.items() if mid in records]
    whole = [(mid, vec) for mid, vec in read if isinstance(vec, bytes) and len(vec) == size]
    if whole:  # one product for all of them
        matrix = np.frombuffer(b"".join([vec for _, vec in whole]), dtype=np.float32).reshape(len(whole), -1)
        cosine.update(zip([mid for mid, _ in whole], (matrix @ query_vec).tolist(), strict=True))
    unvectored = [records[mid] for mid, vec in read if not (isinstance(vec, bytes) and len(vec) == size)]
    if unvectored:
        await _backfill(svc, org, agent, unvectored, query_vec, cosine)
    return records


async def _read_missing(svc: MemoryService, org: str, agent: str, found: Candidates, sfield: str
                        ) -> dict[str, bytes | None]:
    """Read the full-text-only candidates' records (into ``found``'s records), token states (into
    its states, with an ``sfield``) and vectors (returned): one query naming their keys, one round
    trip and one reply (a memory deleted since reads as absent)."""
    text_of, _, raws, states = found
    prefix, vfield = memory_key_prefix(org, agent), vector_field(svc.embedder.name)
    missing = [m for m in text_of if m not in raws]
    vectors: dict[str, bytes | None] = {}
    if not missing:
        return vectors
    fields = ("rec", vfield, sfield) if sfield else ("rec", vfield)
    query = search_args(tenant_query(org, agent), limit=len(missing), returns=fields, scored=False,
                        in_keys=[f"{prefix}{m}" for m in missing])
    got = fields_of((await _engine(svc, org, agent, [("FT.SEARCH", svc.index_name(org, agent), *query)]))[0],
                    prefix, fields)
    for m in missing:
        row = got.get(m) or [None, None, None]
        raws[m], vectors[m] = row[0], row[1]
        if sfield:
            states[m] = row[2]
    return vectors


async def _agent_size(svc: MemoryService, org: str, agent: str) -> int:
    """The agent's memory count as its last search saw it (it only picks the vector query's
    strategy, never what a search may see); read from Redis on the agent's first search."""
    size = svc.agent_sizes.get((org, agent))
    if size is None:
        size = int(await svc.redis.scard(memory_ids_key(org, agent)))
        _remember_size(svc, org, agent, size)
    return size


async def has_memories(svc: MemoryService, org: str, agent: str) -> bool:
    """Whether a search of the agent may find memories: the service's writes counted some (a count
    remembered as 0 is read again: a write may have come since), or its index exists (records
    written by another tool are found through it). On a cluster, where each agent has its own index,
    a search of an agent with neither is answered empty before its question is embedded and before
    an index is made for it: a caller naming agent after agent costs a count, not an index each. On
    one server the index is the org's, one per org, and a search may make it as a write would."""
    if await _agent_size(svc, org, agent) or not svc.per_agent_indexes:
        return True
    size = int(await svc.redis.scard(memory_ids_key(org, agent)))
    _remember_size(svc, org, agent, size)
    return size > 0 or await svc.index_exists(org, agent)


def _remember_size(svc: MemoryService, org: str, agent: str, size: int) -> None:
    if len(svc.agent_sizes) >= AGENT_SIZES_KEPT and (org, agent) not in svc.agent_sizes:
        svc.agent_sizes.clear()  # bounded: a cleared entry costs one SCARD
    svc.agent_sizes[(org, agent)] = size


async def _run(svc: MemoryService, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The commands on one pipeline of the search's client (RESP2: ``MemoryService.search_redis``): one round trip."""
    async with svc.search_redis.pipeline(transaction=False) as pipe:
        for args in commands:
            pipe.execute_command(*args)
        return list(await pipe.execute())


async def _backfill(svc: MemoryService, org: str, agent: str, recs: Sequence[MemoryRecord],
                    query_vec: Vectors, cosine: dict[str, float]) -> None:
    """Embed memories found by full text that have no vector for this embedder, store the
    vectors (so the vector side finds them from now on) and add their cosines."""
    if not recs:
        return
    vectors = await svc.embed([r.content for r in recs])
    new = {r.memory_id: np.asarray(v, dtype=np.float32) for r, v in zip(recs, vectors, strict=True)}
    await store.store_vectors(svc.redis, org, agent, new, svc.embedder.name)
    for mid, vec in new.items():
        cosine[mid] = float(vec @ query_vec)


async def rank_hot(svc: MemoryService, org: str, agent: str, found: list[tuple[MemoryRecord, float]],
                   vectors: dict[str, Vectors], query: str, deadline: float | None = None) -> Response:
    """The hot list ordered by composite with each hit's relevance to ``query`` (``vectors``: the
    stored ones, read with the list by ``reads.hot_with_vectors``; missing ones are embedded). The
    query's embedding does not start after ``deadline`` (``memory.service.deadline``)."""
    text = svc.query_text(query)
    ids = [rec.memory_id for rec, _ in found]
    missing = [rec for rec, _ in found if rec.memory_id not in vectors]
    if missing:  # written by hand or by another embedder: embed and store them now
        new = {rec.memory_id: np.asarray(vec, dtype=np.float32)
               for rec, vec in zip(missing, await svc.embed([r.content for r in missing]), strict=True)}
        await store.store_vectors(svc.redis, org, agent, new, svc.embedder.name)
        vectors.update(new)
    query_vec = await svc.query_vector(org, text, deadline)
    cosines = cosine_scores(np.stack([vectors[i] for i in ids]), query_vec) if ids else np.zeros(0)
    relevance = [hot_relevance(float(c), s) for (_, s), c in zip(found, cosines.tolist(), strict=True)]
    return _ranked(svc, f"{org}/{agent}", [rec for rec, _ in found], relevance, salience=[s for _, s in found],
                   floor=0.0, limit=len(found))
