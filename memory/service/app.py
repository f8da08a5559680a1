"""The reference memory service: the platform's memory HTTP contract over Redis (Starlette).

    GET  /v1/memories/hot?agent_id=A&limit=N[&query=Q]  N in [0, 20], default 20 -> {"memories": [hit]}
    POST /v1/memories/search   {query, agent_id, limit<=50, min_similarity}   -> {"memories": [hit]}
    POST /v1/memories          {agent_id, content, category, ...}             -> 201 {"memory_id", ...}
    GET  /healthz                                                             -> 200 | 503
    PUT|GET|DELETE /_faults    (only with enable_faults, which the server allows on loopback only)

    hit = {memory_id, content, category, similarity, confidence, rank, created_at, usefulness,
           access_count[, relevance, composite, components, salience]}; rank is the 1-based
           position; for hot hits similarity is the stored salience. Search hits, and hot hits
           when the call sends the question (``query``), also carry their relevance, the
           five-part composite and its components (``memory.service.search``); hot hits their salience.

Every /v1 call needs ``Authorization: Bearer <org token>`` (``shared.security.tenancy``); the org id comes
from the token only and scopes every Redis key; it is checked before anything else, injected
faults included. Errors are ``{"error": message}`` with 400 (bad input), 401 (token), 404/405
(no trailing-slash redirects), 409 (the agent is at its memory cap, the org at its agents cap or its
storage budget: the body's ``field`` names the setting), 413 (body too large), 503
(Redis unreachable); the service keeps serving after any of them. An agent with no data is not an
error: 200 with an empty list.

One tenant cannot starve the others (docs/security.md "Degradation and security"): a search embeds and
matches only the first ``max_query_chars`` characters of its query, large texts are embedded in a
worker thread, and each org has at most ``max_concurrent_per_org`` searches and writes computing
at once. Reads are total and bounded: a stored record that no longer validates is skipped and
counted (``records_skipped`` in ``/healthz``), never a 500 for its agent, and an answer ends
before the hit that would take it over ``max_answer_bytes`` (``answers_trimmed``).

This module holds the routes and handlers; request parsing and error bodies are in
``memory.service.http``, the service's state and bounded answers in ``memory.service.state``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ...shared.stores import storage
from ...shared.wire.errors import StorageQuotaExceeded
from ..embedders.embed import Embedder, load_embedder
from ..embedders.errors import EmbeddingFailed
from ..store import quotas, reads
from ..store import writes as store
from ..store.records import MemoryRecord
from ..store.writes import AgentFull, WriteContention
from .config import MemoryConfig
from .deadline import DeadlinePassed, check, deadline_of
from .http import (
    ApiError,
    agent_id_param,
    error_response,
    parse_json_object,
    query_params,
    read_body,
    validate_body,
)
from .models import (
    HOT_LIMIT_MAX,
    MAX_QUERY_CHARS,
    FaultSpec,
    SearchBody,
    WriteMemory,
)
from .search import has_memories, rank_hot
from .search import search as run_search
from .state import MemoryService, OrgLimiter

log = logging.getLogger(__name__)

__all__ = ["ApiError", "MemoryService", "OrgLimiter", "create_app", "parse_json_object"]

Handler = Callable[[Request], Awaitable[Response]]

def _failure(name: str, exc: Exception) -> Response:
    """The answer to a handler's failure that is not an ``ApiError``."""
    if isinstance(exc, EmbeddingFailed):  # a remote embeddings endpoint's failure, named
        return error_response(503, str(exc))
    if isinstance(exc, ClientDisconnect):  # the caller gave up (its deadline) before sending the whole body
        return error_response(499, "client closed the request before its body arrived")
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        log.warning("redis unavailable: %s", exc)
        return error_response(503, "memory store unavailable")
    if isinstance(exc, RedisError):
        log.error("redis error: %s", exc)
        return error_response(503, "memory store error")
    log.error("unhandled error in %s", name, exc_info=exc)
    return error_response(500, "internal error")


def _endpoint(fn: Callable[[MemoryService, Request], Awaitable[Response]]) -> Callable[[MemoryService], Handler]:
    """Wrap a handler: map errors to JSON responses and log one line with its timing."""

    def bind(svc: MemoryService) -> Handler:
        @functools.wraps(fn)
        async def handler(request: Request) -> Response:
            t0, quiet = time.perf_counter(), False
            try:
                response = await fn(svc, request)
            except ApiError as exc:
                response = error_response(exc.status, exc.message, exc.field)
                if isinstance(exc, DeadlinePassed):  # counted; under overload too many to log at INFO
                    svc.deadline_dropped += 1
                    quiet = True
            except Exception as exc:
                response = _failure(fn.__name__, exc)
            # One line per call that went wrong; the 200s only at DEBUG (formatting and writing a
            # line for every read is CPU spent on every assembly).
            level = logging.DEBUG if response.status_code < 400 or quiet else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s %s %d %.2fms", request.method, request.scope["path"], response.status_code,
                        (time.perf_counter() - t0) * 1000.0)
            return response

        return handler

    return bind


# ------------------------------------------------------------------------------------ handlers


@_endpoint
async def hot(svc: MemoryService, request: Request) -> Response:
    received = time.monotonic()
    org, fault = await svc.admit(request, "hot")
    if fault is not None:
        return fault
    deadline = deadline_of(request, received)
    check(deadline, "the hot list's read")
    params = query_params(request, ("agent_id", "limit", "query"))
    agent = agent_id_param(params.get("agent_id"))
    raw_limit = params.get("limit", str(HOT_LIMIT_MAX))
    if not (raw_limit.isascii() and raw_limit.isdigit()) or len(raw_limit) > 6 or int(raw_limit) > HOT_LIMIT_MAX:
        raise ApiError(400, f"limit must be an integer from 0 to {HOT_LIMIT_MAX}", field="limit")
    query = params.get("query")
    if query is not None and len(query) > MAX_QUERY_CHARS:
        raise ApiError(400, f"query must be at most {MAX_QUERY_CHARS} characters", field="query")
    embedder = svc.embedder
    found, vectors = await reads.hot_with_vectors(
        svc.scripts, org, agent, int(raw_limit), embedder_name=None if query is None else embedder.name,
        dim=embedder.dim, health=svc.health)
    if query is None or not found:
        return svc.answer(found, f"{org}/{agent}")
    # No search slot (memory.service.fair_slots): ranking the hot list is a cosine over at most
    # HOT_LIMIT_MAX stored vectors, and the question's embedding is the query batcher's, shared
    # with the same assembly's search.
    return await rank_hot(svc, org, agent, found, vectors, query, deadline)


@_endpoint
async def search(svc: MemoryService, request: Request) -> Response:
    received = time.monotonic()
    org, fault = await svc.admit(request, "search")
    if fault is not None:
        return fault
    deadline = deadline_of(request, received)
    query_params(request, ())
    body = validate_body(SearchBody, parse_json_object(await read_body(request, svc.config.max_body_bytes)))
    if body.limit == 0 or not await has_memories(svc, org, body.agent_id):
        return JSONResponse({"memories": []})
    return await run_search(svc, org, body, deadline)


@_endpoint
async def write(svc: MemoryService, request: Request) -> Response:
    org = svc.org_of(request)
    query_params(request, ())
    body = validate_body(WriteMemory, parse_json_object(await read_body(request, svc.config.max_body_bytes)))
    record = MemoryRecord(
        memory_id=body.memory_id or f"m-{uuid.uuid4().hex}",
        content=body.content, category=body.category, confidence=body.confidence,
        usefulness=body.usefulness, access_count=body.access_count,
        created_at=body.created_at or datetime.fromtimestamp(svc.clock(), UTC),
        salience=body.salience if body.salience is not None else body.confidence, subject=body.subject,
    )
    redis = svc.redis
    try:
        async with svc.write_limiter.hold(org), svc.limiter.hold(org), svc.write_embeds:
            pressure = await svc.store_pressure.read(redis)
            quotas.check_floor(pressure, svc.config.write_floor_fraction)
            await quotas.check_agents(redis, svc.config.quotas, org, body.agent_id)
            charge = store.memory_charge(org, body.agent_id, record, hot=body.hot, embedder_name=svc.embedder.name,
                                         dim=svc.embedder.dim, state_bytes=await svc.state_bytes(record.content))
            # A rewrite is charged what it adds: the memory it replaces is credited in the same step.
            assumed = await store.stored_charge(redis, org, body.agent_id, record.memory_id)
            await storage.reserve(redis, org, charge, svc.config.org_storage_budget(pressure.limit), what="content",
                                  replacing=assumed, index=storage.INDEX_BYTES)
            try:
                await svc.ensure_index(org, body.agent_id)
                replaced = await store.write_capped(redis, store.NewMemory(org, body.agent_id, record, body.hot),
                                                    embedder_name=svc.embedder.name, embed=svc.embed_memories,
                                                    max_per_agent=svc.config.max_memories_per_agent, charge=charge)
            except BaseException:
                # Nothing stored: the reservation back, and the charge of the memory still there.
                await asyncio.shield(storage.credit(redis, org, charge - assumed))
                raise
            await storage.credit(redis, org, replaced - assumed)  # another write replaced it meanwhile
            await quotas.account_write(redis, org, body.agent_id)
    except quotas.QuotaExceeded as exc:
        raise ApiError(409, str(exc), field=exc.field) from exc
    except StorageQuotaExceeded as exc:
        raise ApiError(409, str(exc), field=exc.field) from exc
    except quotas.StoreFull as exc:
        raise ApiError(507, str(exc)) from exc
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
    info: dict[str, Any] = {"embedder": svc.embedder.name, "embedder_runtime": getattr(svc.embedder, "runtime", None),
                            "embedder_weights": getattr(svc.embedder, "weights", None),
                            "faults_enabled": svc.faults is not None,
                            "records_skipped": svc.health.skipped, "queries_truncated": svc.queries_truncated,
                            "embeds_offloaded": svc.embeds_offloaded, "answers_trimmed": svc.answers_trimmed,
                            "deadline_dropped": svc.deadline_dropped,
                            "embeds_refused": svc.embeds_refused, "queries_bulk": svc.queries_bulk,
                            "searches_waited": svc.read_slots.waited,
                            "searches_refused": svc.read_slots.refused,
                            "common_words_scored": svc.terms.scored}
    try:
        await svc.redis.ping()
    except (RedisError, OSError, ApiError) as exc:
        return JSONResponse({**info, "status": "degraded", "redis": "down", "error": str(exc)[:200]},
                            status_code=503)
    return JSONResponse({**info, "status": "ok", "redis": "ok"})


@_endpoint
async def put_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    spec = validate_body(FaultSpec, parse_json_object(await read_body(request, 64 * 1024)))
    svc.faults.set(spec)
    return JSONResponse({"faults": svc.faults.snapshot()})


@_endpoint
async def get_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    return JSONResponse({"faults": svc.faults.snapshot()})


@_endpoint
async def delete_faults(svc: MemoryService, request: Request) -> Response:
    assert svc.faults is not None
    endpoint = query_params(request, ("endpoint",)).get("endpoint", "all")
    if endpoint not in ("hot", "search", "all"):
        raise ApiError(400, "endpoint must be hot, search or all", field="endpoint")
    svc.faults.clear(endpoint)
    return JSONResponse({"faults": svc.faults.snapshot()})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail))


class MemoryApp(Starlette):
    """Starlette with the two reads of every assembly dispatched straight to their handlers.

    Each handler already turns every exception into a JSON response (``_endpoint``), so Starlette's
    error middlewares and router add nothing to them but a tenth of their CPU. Any other
    method or path (HEAD, a trailing slash, the writes, faults) goes through Starlette.
    """

    direct: dict[tuple[str, str], Handler]  # set by create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.direct.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(
    config: MemoryConfig,
    *,
    enable_faults: bool = False,
    embedder: Embedder | None = None,
    clock: Callable[[], float] = time.time,
) -> MemoryApp:
    """Build the ASGI app. ``clock`` (epoch seconds) is only used for recency and defaults."""
    embedder = embedder or load_embedder(config.embedder, config.embedder_config())
    svc = MemoryService(config, embedder, enable_faults=enable_faults, clock=clock)

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
    app = MemoryApp(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.direct = {("GET", "/v1/memories/hot"): hot(svc), ("POST", "/v1/memories/search"): search(svc)}
    # No 307 to the slash-less path: Starlette builds that Location from the Host header, so any
    # caller could make the service redirect to a host of its choosing. A wrong path is a 404.
    app.router.redirect_slashes = False
    app.state.service = svc
    return app
