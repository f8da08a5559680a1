"""Retrieval: exactly three concurrent branches under one wall (docs/architecture.md "Processes and data flow").

    directive  Redis  {org_id}:directive:{agent_id}          5 ms   (with summary_key: MGET, the stored
                      {org_id}:summary:{agent_id}:{key}             summary in the same round trip)
    hot        GET  /v1/memories/hot     (memory service)   15 ms   with the question: ranked for it
    cold       POST /v1/memories/search  (embeds inside)    45 ms

There is no history branch: recent messages arrive in the request. Each branch gets
``min(its own timeout, the wall)``; a late branch is cancelled and recorded as ``timeout``,
completed branches are kept. Cancelled tasks are not awaited (their cleanup could overrun the
wall); they are parked in a set and reaped by a done-callback.

Limits (``worker.patience``): each one (each branch's and the wall) reads the sockets once more when
its timer fires late. The directive's limit also gets back ``busy``, the loop's measured CPU-turn
time (ns, cumulative), and the wall does not end it: it runs to its own limit, never past
``last_ns`` (default: the wall), the latest end the request's deadline allows. A directive GET
that runs out of its time is asked again on a fresh connection (a stuck one is not waited on
twice) while a whole directive limit fits before ``last_ns``, the last try waited for up to it:
a caller that allows the time never gets a prompt without the directive Redis holds.

Each memory-service call carries its branch's time left as ``Ibex-Timeout-Ms``, so the service
starts no embedding or search for a call this worker has already given up on (docs/deploy.md
"Backing services"): under overload that work would only delay the calls still waiting.

Security: every call is scoped to the request's org (the Redis key, and an org-bound bearer token
for the memory service). A failed branch yields nothing: no fallback query, no other tenant's data,
no invented memory. What a hit must look like is ``pipeline.selection.hits`` (one memory-hit contract).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..pipeline.selection.hits import (
    below_cutoff,
    hit_problem,
    memory_id_problem,
    over_cap,
    plain_hit,
    to_hit,
)
from ..pipeline.types import MemoryHit, Rejection, RetrievalResult
from ..shared.config.settings import WorkerSettings
from ..shared.security.tenancy import mint_org_token
from ..shared.stores.connect import async_client
from ..shared.stores.directives import MalformedDirective, get_directive, parse_envelope
from ..shared.stores.keys import directive_key, summary_key
from ..shared.wire.models import AssembleRequest, BranchName, Source
from . import rawredis
from .branches import Branch, Stored, retrieval_result
from .memgate import AT_CAPACITY
from .memhttp import ConnectError, MalformedResponse, ResponseTooLarge
from .memservices import MemoryServices, memory_urls
from .patience import Limit, Patience, all_done_future, expire_now, settle

__all__ = ["ConnectError", "MalformedResponse", "MemoryServiceStatus", "ResponseTooLarge", "Retriever", "parse_hits"]

log = logging.getLogger(__name__)

# When the running branch gives up (monotonic ns): set by ``Retriever._run`` in the branch's own
# task, read by ``Retriever._fetch`` for the ``Ibex-Timeout-Ms`` header.
_BRANCH_END_NS: contextvars.ContextVar[int | None] = contextvars.ContextVar("branch_end_ns", default=None)

# The question sent with the hot call, in its URL: the memory service embeds at most its
# IBEX_MEMORY_MAX_QUERY_CHARS (1,000 by default) leading characters anyway.
HOT_QUERY_CHARS = 1_000

# A directive GET that runs out of its time is asked this many more times while the request's
# deadline leaves a whole directive limit, the last time waited for up to that deadline: a prompt
# without its directive is the worst a degraded answer can be, and a caller that allows the time
# gets it (a busy box can stall Redis or this process for tens of ms).
DIRECTIVE_RETRIES = 2


class MemoryServiceStatus(Exception):
    """The memory service answered with a non-2xx status."""


def _error_class(exc: BaseException) -> str:
    if isinstance(exc, MemoryServiceStatus):
        return f"HTTP {exc.args[0]}"
    return type(exc).__name__


def parse_hits(body: bytes, source: Source, cap: int) -> tuple[list[MemoryHit], list[Rejection]]:
    """Parse the memory service's ``{"memories": [...]}``; bad hits are rejected, not guessed."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedResponse(f"body is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("memories"), list):
        raise MalformedResponse("body has no 'memories' list")
    hits: list[MemoryHit] = []
    rejects: list[Rejection] = []
    for i, raw in enumerate(doc["memories"]):
        hit = plain_hit(raw, source)
        if hit is None:  # broken, or sound in a rarer form: the full check says which
            problem = hit_problem(raw)
            if problem:
                rejects.append(Rejection(_named(raw, source, i), source, "malformed", f"{source} hit {i}: {problem}"))
                continue
            hit = to_hit(raw, source)
        if len(hits) >= cap:
            rejects.append(over_cap(hit.memory_id, source, cap))  # a sound hit: its id is valid
        else:
            hits.append(hit)
    if "below_cutoff" in doc:  # search answers: the candidates just under its line (explain shows them)
        rejects += below_cutoff(doc["below_cutoff"], source)
    return hits, rejects


def _named(raw: object, source: Source, i: int) -> str:
    """A refused hit's memory_id when it is a valid one, else its place in the answer."""
    mid = raw.get("memory_id") if isinstance(raw, dict) else None
    return mid if isinstance(mid, str) and memory_id_problem(mid) is None else f"<{source}#{i}>"


class Retriever:
    """One per worker process: one pooled HTTP client and one Redis pool, created once."""

    def __init__(self, *, settings: WorkerSettings, redis: Redis,
                 directives: rawredis.Connection | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.directives = directives  # the directive GET's own connections; None: through redis-py
        self.http = MemoryServices(memory_urls(settings.memory_url), max_body=settings.memory_max_response_bytes,
                                   max_idle=settings.worker_concurrency * 2)
        self._auth: dict[str, bytes] = {}  # org -> its bearer header line, minted once
        self._orphans: set[asyncio.Task[Any]] = set()

    @classmethod
    def create(cls, settings: WorkerSettings, redis_url: str) -> Retriever:
        wall_s = settings.retrieval_wall_ms / 1000
        redis = async_client(
            redis_url, socket_timeout=max(wall_s, 0.05), socket_connect_timeout=max(wall_s, 0.05),
            max_connections=settings.worker_concurrency * 2, decode_responses=False,
        )
        directives = rawredis.Connection.for_url(redis_url, max_idle=settings.worker_concurrency * 2)
        return cls(settings=settings, redis=redis, directives=directives)

    async def warm_up(self) -> None:
        """Open the Redis and HTTP connections now, not inside the first request's 5 ms budget."""
        try:
            await self.redis.ping()
            if self.directives is not None:
                async with asyncio.timeout(2.0):
                    await self.directives.get(directive_key("ibex-warmup", "warmup"))
        except Exception as exc:  # the service must still start; requests will report the branch error
            log.warning("redis not reachable at start-up: %r", exc)
        try:
            async with asyncio.timeout(2.0):
                await self.http.call("GET", "/healthz", b"")
            # Exercise both memory routes once (a throwaway org with no data) so neither this
            # process nor the service pays first-call costs inside a live request's budget.
            warm = AssembleRequest(request_id="warm-up", org_id="ibex-warmup", agent_id="warmup", model="-",
                                   query="warm up", deadline_ns=1)
            async with asyncio.timeout(2.0):  # the client sets no timeout of its own: a hung service must not hang us
                await self._hot(warm)
                await self._cold(warm)
        except (ConnectionError, TimeoutError, MalformedResponse, MemoryServiceStatus) as exc:
            log.warning("memory service not ready at start-up: %r", exc)

    async def aclose(self) -> None:
        for t in list(self._orphans):
            t.cancel()
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        self.http.close()
        if self.directives is not None:
            self.directives.close()
        await self.redis.aclose()

    def _auth_line(self, org_id: str) -> bytes:
        """The org's bearer header line (its token minted once per process)."""
        line = self._auth.get(org_id)
        if line is None:
            token = mint_org_token(self.settings.memory_secret, org_id)
            line = self._auth[org_id] = f"Authorization: Bearer {token}\r\n".encode("latin-1")
        return line

    # ------------------------------------------------------------------------------- branches

    async def _directive(self, req: AssembleRequest) -> str | None:
        if self.directives is None:
            env = await get_directive(self.redis, req.org_id, req.agent_id)
        else:  # what get_directive does, on the leaner connection
            key = directive_key(req.org_id, req.agent_id)
            try:
                raw = await self.directives.get(key)
            except rawredis.ReplyError as exc:  # e.g. WRONGTYPE: a hash where a string belongs
                raise MalformedDirective(key, str(exc)) from exc
            env = None if raw is None else parse_envelope(key, raw)
        return env.text if env is not None else None

    async def _with_summary(self, req: AssembleRequest, stored: Stored) -> str | None:
        """The directive and the stored summary in one round trip (the summary alone when the
        request turned the directive off). The summary's raw value is kept before the directive
        is parsed, so a damaged directive costs the directive only."""
        assert req.summary_key is not None
        skey = summary_key(req.org_id, req.agent_id, req.summary_key)
        if not req.options.include_directive:
            try:
                stored.raw = _bytes(await (self.redis.get(skey) if self.directives is None
                                           else self.directives.get(skey)))
            except (rawredis.ReplyError, ResponseError) as exc:  # e.g. WRONGTYPE: the summary part only
                stored.problem = str(exc)
            stored.fetched = True
            return None
        dkey = directive_key(req.org_id, req.agent_id)
        got = await (self.redis.mget([dkey, skey]) if self.directives is None else self.directives.mget(dkey, skey))
        raw, stored.raw = _bytes(got[0]), _bytes(got[1])
        stored.fetched = True
        return None if raw is None else parse_envelope(dkey, raw).text

    async def _fetch(self, method: str, path: str, org_id: str, *, params: dict[str, str] | None = None,
                     body: bytes | None = None) -> bytes:
        headers = self._auth_line(org_id)
        end_ns = _BRANCH_END_NS.get()
        if end_ns is not None:
            left_ms = max(0.0, (end_ns - time.monotonic_ns()) / 1e6)
            headers += f"Ibex-Timeout-Ms: {left_ms:.1f}\r\n".encode()
        status, data = await self.http.call(method, path, headers, params=params, body=body)
        if status != 200:
            raise MemoryServiceStatus(status)
        return data

    async def _hot(self, req: AssembleRequest) -> tuple[list[MemoryHit], list[Rejection]]:
        cap = self.settings.hot_limit
        params = {"agent_id": req.agent_id, "limit": str(cap)}
        if req.query:  # ranked for the question by the memory service (docs/selection-quality.md)
            params["query"] = req.query[:HOT_QUERY_CHARS]
        body = await self._fetch("GET", "/v1/memories/hot", req.org_id, params=params)
        return parse_hits(body, "hot", cap)

    async def _cold(self, req: AssembleRequest) -> tuple[list[MemoryHit], list[Rejection]]:
        cap = self.settings.cold_limit
        payload: dict[str, Any] = {"query": req.query, "agent_id": req.agent_id, "limit": cap}
        if self.settings.cold_min_similarity is not None:  # else the memory service's embedder's own
            payload["min_similarity"] = self.settings.cold_min_similarity
        body = await self._fetch("POST", "/v1/memories/search", req.org_id, body=orjson.dumps(payload))
        return parse_hits(body, "cold", cap)

    # ---------------------------------------------------------------------------- orchestration

    def start(self, req: AssembleRequest, *, wall_end_ns: int, last_ns: int | None = None,
              busy: Callable[[], int] | None = None, memory: bool = True) -> Callable[[], Awaitable[RetrievalResult]]:
        """Launch the branches now; the returned coroutine function waits for them (up to the wall).

        Splitting start from wait lets the caller do CPU work while the I/O is in flight (the
        conversation is parsed and counted before: a bad one costs no call). ``busy``, ``last_ns``: "Limits" above.
        ``memory`` False: the memory service is not called (``worker.memgate``: at capacity); its
        branches are recorded as errors ``MemoryAtCapacity``, so the answer says it is degraded and why.
        """
        s = self.settings
        t0 = time.monotonic_ns()
        last_ns = wall_end_ns if last_ns is None else max(last_ns, wall_end_ns)
        opts = req.options
        stored = Stored(wanted=req.summary_key is not None and req.summary is None)
        directive: Callable[[AssembleRequest], Awaitable[Any]] = (
            functools.partial(self._with_summary, stored=stored) if stored.wanted else self._directive)
        plan: list[tuple[BranchName, bool, float, Callable[[AssembleRequest], Awaitable[Any]]]] = [
            ("directive", opts.include_directive or stored.wanted, s.directive_timeout_ms, directive),
            ("hot", opts.include_hot and s.hot_limit > 0, s.hot_timeout_ms, self._hot),
            ("cold", opts.include_cold and s.cold_limit > 0, s.cold_timeout_ms, self._cold),
        ]
        branches: dict[BranchName, Branch] = {}
        tasks: dict[BranchName, asyncio.Task[None]] = {}
        for name, enabled, timeout_ms, fn in plan:
            br = branches[name] = Branch(name)
            budget_ns = min(int(timeout_ms * 1e6), wall_end_ns - t0)
            if _unstarted(br, enabled=enabled, memory=memory, budget_ns=budget_ns):
                continue
            limit = (Limit(t0, budget_ns, last_ns, busy, DIRECTIVE_RETRIES) if name == "directive"
                     else Limit(t0, budget_ns, wall_end_ns, None))
            tasks[name] = asyncio.create_task(self._run(br, fn, req, limit), name=f"retrieve-{name}")

        all_done = all_done_future(list(tasks.values()))

        async def wait() -> RetrievalResult:
            if tasks:
                if not all_done.done():
                    wall = Patience(start_ns=t0, budget_ns=wall_end_ns - t0, last_ns=wall_end_ns,
                                    expire=functools.partial(settle, all_done))
                    try:
                        await all_done
                    finally:
                        wall.cancel()
                directive = tasks.get("directive")
                if directive is not None and not directive.done():  # its own limit ends it by last_ns
                    await asyncio.wait({directive}, timeout=max(0.0, (last_ns - time.monotonic_ns()) / 1e9) + 0.01)
                late = [task for task in tasks.values() if not task.done()]
                for task in late:  # backstop: each branch already has its own timeout
                    task.cancel()
                    self._orphans.add(task)
                    task.add_done_callback(self._reap)
                    br = branches[_task_branch(task)]
                    br.status, br.error_class = "timeout", "WallExceeded"
                    br.elapsed_ms = (time.monotonic_ns() - t0) / 1e6
            return retrieval_result(branches, stored, include_directive=opts.include_directive)

        return wait

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("late branch %s ended with %r", task.get_name(), task.exception())

    async def _run(self, br: Branch, fn: Callable[[AssembleRequest], Awaitable[Any]], req: AssembleRequest,
                   limit: Limit) -> None:
        loop = asyncio.get_running_loop()
        start_ns = limit.t0
        try:
            for attempt in range(limit.retries + 1):
                budget_ns = limit.budget_ns
                if attempt:  # a fresh limit from now; the last try waits up to last_ns
                    start_ns = time.monotonic_ns()
                    if start_ns + budget_ns > limit.last_ns:
                        break
                    budget_ns = limit.last_ns - start_ns if attempt == limit.retries else budget_ns
                cm = asyncio.timeout(None)
                try:
                    async with cm:
                        patience = Patience(start_ns=start_ns, budget_ns=budget_ns, last_ns=limit.last_ns,
                                            busy=limit.busy, expire=functools.partial(expire_now, cm, loop))
                        _BRANCH_END_NS.set(patience.due_ns)  # this task's own context: the other branches keep theirs
                        try:
                            br.value = await fn(req)
                        finally:
                            patience.cancel()
                            br.given_back_ns += patience.given_back_ns()
                except TimeoutError:
                    if not cm.expired():
                        raise
                    br.attempts = attempt + 1
                    continue
                br.status = "success"
                return
            br.status, br.error_class = "timeout", "TimeoutError"
            if br.attempts > 1 or br.given_back_ns:
                busy_ms = br.given_back_ns / 1e6
                br.detail = (f"no answer in {br.attempts} tries ({limit.budget_ns / 1e6:g} ms; the last: to the end)"
                             + (f" (plus {busy_ms:.1f} ms the worker's loop was busy)" if busy_ms else ""))
        except TimeoutError:
            br.status, br.error_class = "timeout", "TimeoutError"
        except asyncio.CancelledError:
            br.status, br.error_class = "timeout", "Cancelled"
            raise
        except Exception as exc:  # every failure of one branch degrades that branch only
            br.status, br.error_class = "error", _error_class(exc)
            br.detail = str(exc)[:200] or None
        finally:
            br.elapsed_ms = (time.monotonic_ns() - limit.t0) / 1e6


def _unstarted(br: Branch, *, enabled: bool, memory: bool, budget_ns: int) -> bool:
    """Record why ``br`` is not started (off, the memory service at capacity, no time left); False
    when it starts."""
    if not enabled:
        br.detail = "disabled by request options or settings"
    elif not memory and br.name != "directive":
        br.status, br.error_class = "error", AT_CAPACITY
        br.detail = "not called: the memory service is at capacity (answered without memories)"
    elif budget_ns <= 0:
        br.status, br.detail = "timeout", "no time left before the deadline"
    else:
        return False
    return True


def _task_branch(task: asyncio.Task[Any]) -> BranchName:
    name = task.get_name().removeprefix("retrieve-")
    assert name in ("directive", "hot", "cold")
    return name  # type: ignore[return-value]


def _bytes(value: bytes | str | None) -> bytes | None:
    """redis-py's reply types say str too; the pool decodes nothing, so it is bytes."""
    return value.encode() if isinstance(value, str) else value


