"""The reference memory service: the platform's memory HTTP contract over Redis (Starlette).

    GET  /v1/memories/hot?agent_id=A&limit=N    N in [0, 20], default 20      -> {"memories": [hit]}
    POST /v1/memories/search   {query, agent_id, limit<=50, min_similarity}   -> {"memories": [hit]}
    POST /v1/memories          {agent_id, content, category, ...}             -> 201 {"memory_id", ...}
    GET  /healthz                                                             -> 200 | 503
    PUT|GET|DELETE /_faults    (only with enable_faults, which the server allows on loopback only)

    hit = {memory_id, content, category, similarity, confidence, rank, created_at, usefulness,
           access_count}; rank is the 1-based position; for hot hits similarity is the stored
           salience (there is no query).

Every /v1 call needs ``Authorization: Bearer <org token>`` (``shared.tenancy``); the org id comes
from the token only and scopes every Redis key; it is checked before anything else, injected
faults included. Errors are ``{"error": message}`` with 400 (bad input), 401 (token), 404/405
(no trailing-slash redirects), 409 (the agent is at its memory cap), 413 (body too large), 503
(Redis unreachable); the service keeps serving after any of them. An agent with no data is not an
error: 200 with an empty list.

One tenant cannot starve the others (README, "Degradation and security"): a search embeds and
matches only the first ``max_query_chars`` characters of its query, large texts are embedded in a
worker thread, and each org has at most ``max_concurrent_per_org`` searches and writes computing
at once. Reads are total and bounded: a stored record that no longer validates is skipped and
counted (``records_skipped`` in ``/healthz``), never a 500 for its agent, and an answer ends
before the hit that would take it over ``max_answer_bytes`` (``answers_trimmed``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ibex_context.memory import store
from ibex_context.memory.config import MemoryConfig
from ibex_context.memory.embed import Embedder, Vectors, content_terms, load_embedder
from ibex_context.memory.faults import MALFORMED_BODY, Faults, drop_connection, huge_body
from ibex_context.memory.models import HOT_LIMIT_MAX, FaultSpec, MemoryRecord, SearchBody, WriteMemory
from ibex_context.memory.rank import Candidate, cosine_scores, keyword_hit, rank_hydrated_hits, select_candidates
from ibex_context.memory.store import AgentFull, RecordHealth, WriteContention
from ibex_context.shared.keys import is_ident
from ibex_context.shared.tenancy import bearer_token, verify_org_token
from ibex_context.shared.validation import first_error

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """An error the client caused (or must be told about), rendered as ``{"error": ...}``."""

    def __init__(self, status: int, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


# ------------------------------------------------------------------------------------- parsing


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]!r} is out of range")
    return value


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Strict JSON: no NaN/Infinity (Python's json accepts them), no overflowing numbers."""
    if not body.strip():
        raise ApiError(400, "request body must be a JSON object")
    try:
        doc = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise ApiError(400, "malformed JSON: nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long, our hooks
        raise ApiError(400, f"malformed JSON: {str(exc)[:200]}") from exc
    if not isinstance(doc, dict):
        raise ApiError(400, "request body must be a JSON object")
    return doc


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise ApiError(413, f"request body over {max_bytes} bytes")
    return bytes(buf)


def _validate(model: type[M], doc: dict[str, Any]) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = first_error(exc, reasons={"extra_forbidden": "unknown field"})
        if err.kind == "extra_forbidden" and err.field == "org_id":
            raise ApiError(400, "org_id is not accepted: the org comes from the bearer token", field=err.field) from exc
        raise ApiError(400, f"{err.field or 'body'}: {err.message}", field=err.field or None) from exc


def _query_params(request: Request, allowed: Sequence[str]) -> dict[str, str]:
    params = request.query_params
    out: dict[str, str] = {}
    for key in params:
        if key == "org_id":
            raise ApiError(400, "org_id is not accepted: the org comes from the bearer token", field=key)
        if key not in allowed:
            raise ApiError(400, f"unknown query parameter {key[:40]!r}", field=key[:40])
        values = params.getlist(key)
        if len(values) != 1:
            raise ApiError(400, f"query parameter {key!r} given more than once", field=key)
        out[key] = values[0]
    return out


def _agent_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, "agent_id is required", field="agent_id")
    if not is_ident(value):
        raise ApiError(400, "agent_id must be 1-64 characters of A-Z a-z 0-9 _ . -", field="agent_id")
    return value


# ------------------------------------------------------------------------------------- service


class OrgLimiter:
    """At most ``limit`` requests of one org inside ``hold`` at once; the rest of that org waits.

    Other orgs never queue behind it, so a tenant sending many expensive searches slows itself,
    not its neighbours. Idle orgs leave no state behind.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._sems: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @asynccontextmanager
    async def hold(self, org: str) -> AsyncIterator[None]:
        entry = self._sems.get(org)
        if entry is None:
            entry = self._sems[org] = (asyncio.Semaphore(self._limit), [0])
        sem, users = entry
        users[0] += 1
        try:
            async with sem:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._sems[org]

    def __len__(self) -> int:
        return len(self._sems)


class MemoryService:
    """State of one running service: config, embedder, Redis client, faults, clock, counters."""

    def __init__(self, config: MemoryConfig, embedder: Embedder, *, enable_faults: bool,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.embedder = embedder
        self.faults = Faults() if enable_faults else None
        self.clock = clock
        self._redis: Redis | None = None
        self.index_cache = store.IndexCache()
        self.health = RecordHealth()
        self.limiter = OrgLimiter(config.max_concurrent_per_org)
        self.queries_truncated = 0
        self.embeds_offloaded = 0
        self.answers_trimmed = 0

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            raise ApiError(503, "memory store not connected")
        return self._redis

    async def open(self) -> None:
        if not self.config.redis_url:
            raise RuntimeError("MemoryConfig.redis_url is not set")
        timeout_s = self.config.redis_timeout_ms / 1000.0
        # One immediate retry (a pooled connection may be stale after a Redis restart), no
        # backoff: callers run on 15-45 ms budgets and need a fast 503, not a slow success.
        self._redis = Redis.from_url(
            self.config.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        load = getattr(self.embedder, "load", None)
        if callable(load):
            await run_in_threadpool(load)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed on the loop when cheap; in a worker thread when the embedder or the text is large."""
        if self.embedder.blocking or sum(map(len, texts)) > self.config.offload_chars:
            self.embeds_offloaded += 1
            return await run_in_threadpool(self.embedder.embed, texts)
        return self.embedder.embed(texts)

    def query_text(self, query: str) -> str:
        """The part of a search query that is embedded and matched (``max_query_chars``)."""
        cap = self.config.max_query_chars
        if len(query) <= cap:
            return query
        self.queries_truncated += 1
        return query[:cap]

    def answer(self, found: Sequence[tuple[MemoryRecord, float]], where: str) -> Response:
        """``{"memories": [hit, ...]}`` for (record, similarity) pairs, best first.

        Total and bounded: a record that cannot be rendered is skipped and counted (the ranks stay
        1, 2, 3, ...), and the list ends before the hit that would take the body over
        ``max_answer_bytes``. Each hit is encoded once, the way ``JSONResponse`` would.
        """
        parts: list[bytes] = []
        size = len(_ANSWER_HEAD) + len(_ANSWER_TAIL)
        for rec, similarity in found:
            try:
                part = _json_bytes(rec.hit(similarity=similarity, rank=len(parts) + 1))
            except (ValueError, OverflowError) as exc:
                self.health.skip(f"{where}/{rec.memory_id}", f"cannot render: {exc}")
                continue
            size += len(part) + (1 if parts else 0)
            if size > self.config.max_answer_bytes:
                self.answers_trimmed += 1
                log.warning("answer for %s trimmed to %d of %d hits (max_answer_bytes %d)", where, len(parts),
                            len(found), self.config.max_answer_bytes)
                break
            parts.append(part)
        return Response(_ANSWER_HEAD + b",".join(parts) + _ANSWER_TAIL, media_type="application/json")

    def org_of(self, request: Request) -> str:
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            raise ApiError(401, "missing bearer token: send Authorization: Bearer <org token>")
        org = verify_org_token(self.config.secret, token)
        if org is None:
            raise ApiError(401, "invalid bearer token")
        return org

    async def fault_response(self, request: Request, endpoint: str) -> Response | None:
        """The injected fault's response, ``None`` to serve normally (after any latency)."""
        spec = self.faults.get(endpoint) if self.faults is not None else None
        if spec is None:
            return None
        if spec.latency_ms > 0:
            await asyncio.sleep(spec.latency_ms / 1000.0)
        if spec.drop:
            client = (request.client.host, request.client.port) if request.client else None
            if await drop_connection(client):
                log.info("fault: dropped the connection of %s without a response", client)
                return Response(status_code=499)  # never sent: the connection is gone
            return _error(500, "injected drop (connection not found; in-process app?)")
        if spec.status is not None:
            return _error(spec.status, f"injected fault: status {spec.status}")
        if spec.malformed:
            return Response(MALFORMED_BODY, media_type="application/json")
        if spec.huge:
            return Response(huge_body(spec.huge_bytes), media_type="application/json")
        return None


_ANSWER_HEAD = b'{"memories":['
_ANSWER_TAIL = b"]}"


def _json_bytes(doc: dict[str, Any]) -> bytes:
    """JSON exactly as Starlette's ``JSONResponse`` renders it."""
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _endpoint(fn: Callable[[MemoryService, Request], Awaitable[Response]]) -> Callable[[MemoryService], Handler]:
    """Wrap a handler: map errors to JSON responses and log one line with its timing."""

    def bind(svc: MemoryService) -> Handler:
        @functools.wraps(fn)
        async def handler(request: Request) -> Response:
            t0 = time.perf_counter()
            try:
                response = await fn(svc, request)
            except ApiError as exc:
                response = _error(exc.status, exc.message, exc.field)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("redis unavailable: %s", exc)
                response = _error(503, "memory store unavailable")
            except RedisError as exc:
                log.error("redis error: %s", exc)
                response = _error(503, "memory store error")
            except Exception:
                log.exception("unhandled error in %s", fn.__name__)
                response = _error(500, "internal error")
            log.info("%s %s %d %.2fms", request.method, request.url.path, response.status_code,
                     (time.perf_counter() - t0) * 1000.0)
            return response

        return handler

    return bind


# ------------------------------------------------------------------------------------ handlers


@_endpoint
async def hot(svc: MemoryService, request: Request) -> Response:
    org = svc.org_of(request)  # before faults: a caller without a valid token never sees one
    fault = await svc.fault_response(request, "hot")
    if fault is not None:
        return fault
    params = _query_params(request, ("agent_id", "limit"))
    agent = _agent_id(params.get("agent_id"))
    raw_limit = params.get("limit", str(HOT_LIMIT_MAX))
    if not (raw_limit.isascii() and raw_limit.isdigit()) or len(raw_limit) > 6 or int(raw_limit) > HOT_LIMIT_MAX:
        raise ApiError(400, f"limit must be an integer from 0 to {HOT_LIMIT_MAX}", field="limit")
    found = await store.load_hot(svc.redis, org, agent, int(raw_limit), svc.health)
    return svc.answer(found, f"{org}/{agent}")


@_endpoint
async def search(svc: MemoryService, request: Request) -> Response:
    org = svc.org_of(request)  # before faults: a caller without a valid token never sees one
    fault = await svc.fault_response(request, "search")
    if fault is not None:
        return fault
    _query_params(request, ())
    body = _validate(SearchBody, parse_json_object(await _read_body(request, svc.config.max_body_bytes)))
    if body.limit == 0:
        return JSONResponse({"memories": []})
    async with svc.limiter.hold(org):
        return await _search(svc, org, body)


async def _search(svc: MemoryService, org: str, body: SearchBody) -> Response:
    embedder = svc.embedder
    index = await store.load_index(svc.redis, org, body.agent_id, embedder_name=embedder.name,
                                   dim=embedder.dim, embed=svc.embed, cache=svc.index_cache, health=svc.health)
    if not index.ids and not index.terms:
        return JSONResponse({"memories": []})
    text = svc.query_text(body.query)
    query_vec = (await svc.embed([text]))[0]
    cosines = cosine_scores(index.matrix, query_vec)
    q_terms = content_terms(text)
    kw = frozenset(mid for mid, terms in index.terms.items() if keyword_hit(q_terms, terms))
    relevance = select_candidates(index.ids, cosines, kw, min_similarity=body.min_similarity,
                                  max_candidates=svc.config.max_candidates)
    records = await store.hydrate(svc.redis, org, body.agent_id, sorted(relevance), svc.health)
    candidates = [
        Candidate(mid, relevance[mid], rec.category, rec.created_at.timestamp(), rec.usefulness,
                  rec.confidence, rec.access_count)
        for mid, rec in records.items()
    ]
    ranked = rank_hydrated_hits(candidates, now_s=svc.clock(), relevance_floor=svc.config.relevance_floor,
                                limit=body.limit)
    return svc.answer([(records[r.candidate.memory_id], r.candidate.relevance) for r in ranked],
                      f"{org}/{body.agent_id}")


@_endpoint
async def write(svc: MemoryService, request: Request) -> Response:
    org = svc.org_of(request)
    _query_params(request, ())
    body = _validate(WriteMemory, parse_json_object(await _read_body(request, svc.config.max_body_bytes)))
    record = MemoryRecord(
        memory_id=body.memory_id or f"m-{uuid.uuid4().hex}",
        content=body.content, category=body.category, confidence=body.confidence,
        usefulness=body.usefulness, access_count=body.access_count,
        created_at=body.created_at or datetime.fromtimestamp(svc.clock(), UTC),
        salience=body.salience if body.salience is not None else body.confidence,
    )
    try:
        async with svc.limiter.hold(org):
            await store.write_capped(svc.redis, store.NewMemory(org, body.agent_id, record, body.hot),
                                     embedder_name=svc.embedder.name, embed=svc.embed,
                                     max_per_agent=svc.config.max_memories_per_agent)
    except AgentFull as exc:
        raise ApiError(409, f"agent_id: {body.agent_id!r} already has {exc.count} memories, the cap is {exc.cap}",
                       field="agent_id") from exc
    except WriteContention as exc:
        raise ApiError(503, "agent_id: the agent's memories kept changing during the write; retry",
                       field="agent_id") from exc
    return JSONResponse({"memory_id": record.memory_id, "agent_id": body.agent_id, "hot": body.hot},
                        status_code=201)


@_endpoint
async def healthz(svc: MemoryService, request: Request) -> Response:
    info: dict[str, Any] = {"embedder": svc.embedder.name, "faults_enabled": svc.faults is not None,
                            "records_skipped": svc.health.skipped, "queries_truncated": svc.queries_truncated,
                            "embeds_offloaded": svc.embeds_offloaded, "answers_trimmed": svc.answers_trimmed}
    try:
        await svc.redis.ping()
    except (RedisError, OSError, ApiError) as exc:
        return JSONResponse({**info, "status": "degraded", "redis": "down", "error": str(exc)[:200]},
                            status_code=503)
    return JSONResponse({**info, "status": "ok", "redis": "ok"})


@_endpoint
async def put_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    spec = _validate(FaultSpec, parse_json_object(await _read_body(request, 64 * 1024)))
    svc.faults.set(spec)
    return JSONResponse({"faults": svc.faults.snapshot()})


@_endpoint
async def get_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    return JSONResponse({"faults": svc.faults.snapshot()})


@_endpoint
async def delete_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    endpoint = _query_params(request, ("endpoint",)).get("endpoint", "all")
    if endpoint not in ("hot", "search", "all"):
        raise ApiError(400, "endpoint must be hot, search or all", field="endpoint")
    svc.faults.clear(endpoint)
    return JSONResponse({"faults": svc.faults.snapshot()})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail))


def create_app(
    config: MemoryConfig,
    *,
    enable_faults: bool = False,
    embedder: Embedder | None = None,
    clock: Callable[[], float] = time.time,
) -> Starlette:
    """Build the ASGI app. ``clock`` (epoch seconds) is only used for recency and defaults."""
    svc = MemoryService(config, embedder or load_embedder(config.embedder), enable_faults=enable_faults,
                        clock=clock)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await svc.open()
        try:
            yield
        finally:
            await svc.close()

    routes = [
        Route("/healthz", healthz(svc), methods=["GET"]),
        Route("/v1/memories/hot", hot(svc), methods=["GET"]),
        Route("/v1/memories/search", search(svc), methods=["POST"]),
        Route("/v1/memories", write(svc), methods=["POST"]),
    ]
    if enable_faults:
        routes += [
            Route("/_faults", put_faults(svc), methods=["PUT"]),
            Route("/_faults", get_faults(svc), methods=["GET"]),
            Route("/_faults", delete_faults(svc), methods=["DELETE"]),
        ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    # No 307 to the slash-less path: Starlette builds that Location from the Host header, so any
    # caller could make the service redirect to a host of its choosing. A wrong path is a 404.
    app.router.redirect_slashes = False
    app.state.service = svc
    return app
