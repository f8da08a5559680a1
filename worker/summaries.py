"""Compaction summaries to store (protocol SUMMARY; README "Compaction summaries").

The broker forwards a summary after it validated it whole and authorized its org and agent, exactly
as it does a usage report; it takes no credit and gets no reply. Here it is validated again (``SummaryWrite``; a bad
one is refused as a typed ``ErrorReply`` value, counted under ``summary_rejected_invalid`` and
logged, never raised), then stored under ``{org}:summary:{agent}:{summary_key}`` with a TTL,
only when its ``covers`` is greater than the stored one's and the org's storage budget allows it
(``shared.stores.storage``: charged in the same script, the summary it replaces credited): one Lua
script, so two writers of the same conversation never let an older summary replace a newer one, and
no summary is stored past its org's budget. A refused one is counted (``summary_refused_quota``) and
kept as the typed ``last_refusal`` naming the setting. With ``as_memory`` it is also
written to the agent's memories through the memory service's own validated write path
(``POST /v1/memories``, the org's token, its quotas), as one ``event`` memory per conversation,
rewritten with each newer summary.

Every outcome is counted in ``stats`` (the worker's heartbeat carries them to the broker's STATUS):
``summary_stored``, ``summary_stale`` (covers not greater), ``summary_rejected_invalid``,
``summary_refused_quota``,
``summary_store_failed``, ``summary_memory_written``, ``summary_memory_failed``,
``summary_dropped_busy``.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..shared.config.settings import WorkerSettings
from ..shared.security.tenancy import mint_org_token
from ..shared.stores import storage
from ..shared.stores.connect import async_client
from ..shared.stores.keys import org_storage_key, summary_key
from ..shared.stores.storage import LEDGER_LUA
from ..shared.stores.summaries import encode_summary
from ..shared.wire.codec import unpack, validate
from ..shared.wire.errors import StorageQuotaExceeded
from ..shared.wire.models import ErrorReply
from ..shared.wire.summary_write import MAX_SUMMARY_BYTES, SummaryWrite
from .memhttp import MalformedResponse
from .memservices import MemoryServices, memory_urls

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # summaries being stored at once; beyond it one is dropped and counted
MEMORY_CATEGORY = "event"

# KEYS[1] the summary's key, KEYS[2] its org's storage ledger; ARGV: the value, its covers, the TTL in
# seconds, the org's storage budget, the value's charge. 1 stored, 0 stale, negative: refused by
# the budget (nothing stored). The summary it replaces is credited what it was charged (its ``charge``).
NEWER_WINS = LEDGER_LUA + """
local cur = redis.call('GET', KEYS[1])
local old_q, old_b = 0, 0
if cur then
  local ok, doc = pcall(cjson.decode, cur)
  if ok and type(doc) == 'table' and tonumber(doc['covers']) and tonumber(doc['covers']) >= tonumber(ARGV[2]) then
    return 0
  end
  if ok and type(doc) == 'table' and tonumber(doc['charge']) then
    old_q, old_b = tonumber(doc['charge']), bucket_of(redis.call('PEXPIRETIME', KEYS[1]))
  end
end
local ttl = tonumber(ARGV[3])
local total = charge(KEYS[2], tonumber(ARGV[4]), tonumber(ARGV[5]), bucket_of((now_s() + ttl) * 1000), old_q, old_b,
                     false)
if total < 0 then return total end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
return 1
"""
_CHARGE_DIGITS = 12  # room the charge takes in the stored value


def memory_id(summary_key_: str) -> str:
    """The one memory a conversation's summaries become (rewritten by each newer one)."""
    return "summary-" + hashlib.sha256(summary_key_.encode()).hexdigest()[:32]


def memory_text(text: str, made_at_s: float) -> str:
    """What the memory says: the summary, dated (its day, UTC)."""
    day = datetime.fromtimestamp(made_at_s, UTC).date().isoformat()
    return f"Conversation summary ({day}): {text}"


def stored_value(write: SummaryWrite, made_at_s: float, key: str) -> tuple[bytes, int]:
    """``shared.stores.summaries``'s format, plus when it was made and what it is charged to its org
    (both ignored by readers), and that charge (``shared.stores.storage.string_cost``)."""
    doc: dict[str, Any] = orjson.loads(encode_summary(write.text, write.covers))
    doc["made_at"] = made_at_s
    charge = storage.string_cost(len(key), len(orjson.dumps(doc)) + len(',"charge":') + _CHARGE_DIGITS)
    doc["charge"] = charge
    return orjson.dumps(doc), charge


class Summaries:
    """One per worker process: summaries in (``submit``, from the broker link), stored off the loop's
    request path in tasks of their own, at most ``MAX_IN_FLIGHT`` at once."""

    def __init__(self, *, redis: Redis, settings: WorkerSettings, memory: MemoryServices | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self.memory = memory
        self.stats: collections.Counter[str] = collections.Counter()
        self.tasks: set[asyncio.Task[bool]] = set()
        self.last_refusal: ErrorReply | None = None
        self._script = redis.register_script(NEWER_WINS)
        self.pressure = storage.StorePressure()  # the server's maxmemory, for the org's budget

    @classmethod
    def create(cls, settings: WorkerSettings) -> Summaries | None:
        """Its own Redis connection (generous timeouts: nobody waits on it) and memory-service pool."""
        if settings.redis_url is None:
            return None
        redis = async_client(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        memory = MemoryServices(memory_urls(settings.memory_url), max_body=64 * 1024, max_idle=2,
                                user_agent="ibex-context-summaries")
        return cls(redis=redis, settings=settings, memory=memory)

    def check(self, payload: bytes) -> SummaryWrite | ErrorReply:
        """The summary, validated, or the typed refusal (counted, logged with the field it names)."""
        write = validate(unpack(payload, max_bytes=MAX_SUMMARY_BYTES), SummaryWrite)
        if isinstance(write, ErrorReply):
            self.stats["summary_rejected_invalid"] += 1
            self.last_refusal = write
            log.info("summary refused (%s): %r", write.field, write.message[:200])
        return write

    def submit(self, payload: bytes) -> None:
        """One forwarded summary: checked now, stored in a task of its own; never raises."""
        write = self.check(payload)
        if isinstance(write, ErrorReply):
            return
        if len(self.tasks) >= MAX_IN_FLIGHT:
            self.stats["summary_dropped_busy"] += 1
            return
        task = asyncio.get_running_loop().create_task(self.store(write))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def store(self, write: SummaryWrite) -> bool:
        """Store it if newer (then, with ``as_memory``, write the memory); True when stored."""
        made_at = write.made_at if write.made_at is not None else time.time()
        ttl = min(self.settings.summary_ttl_s, write.ttl_s or self.settings.summary_ttl_s)
        key = summary_key(write.org_id, write.agent_id, write.summary_key)
        value, charge = stored_value(write, made_at, key)
        try:
            budget = self.settings.org_storage_budget((await self.pressure.read(self.redis)).limit)
            stored = int(await self._script(keys=[key, org_storage_key(write.org_id)],
                                            args=[value, write.covers, ttl, budget, charge]))
        except (RedisError, OSError) as exc:
            self.stats["summary_store_failed"] += 1
            log.warning("storing summary %s failed: %s", write.request_id, exc)
            return False
        if stored < 0:
            self._over_budget(storage.refused(write.org_id, -stored - 1, charge, budget, "summary"), write)
            return False
        if not stored:
            self.stats["summary_stale"] += 1
            return False
        self.stats["summary_stored"] += 1
        if write.as_memory and self.memory is not None:
            await self._remember(write, made_at)
        return True

    def _over_budget(self, exc: StorageQuotaExceeded, write: SummaryWrite) -> None:
        """A summary the org's storage budget refused: counted, kept as the last refusal, logged."""
        self.stats["summary_refused_quota"] += 1
        self.last_refusal = ErrorReply(request_id=write.request_id, code=exc.code, message=exc.message,
                                       field=exc.field)
        log.info("summary %s refused: %s", write.request_id, exc.message)

    async def _remember(self, write: SummaryWrite, made_at_s: float) -> None:
        assert self.memory is not None
        body = orjson.dumps({"agent_id": write.agent_id, "memory_id": memory_id(write.summary_key),
                             "content": memory_text(write.text, made_at_s), "category": MEMORY_CATEGORY,
                             "created_at": datetime.fromtimestamp(made_at_s, UTC).isoformat()})
        token = mint_org_token(self.settings.memory_secret, write.org_id)
        headers = f"Authorization: Bearer {token}\r\n".encode()
        try:
            async with asyncio.timeout(self.settings.summary_memory_timeout_ms / 1000):
                status, answer = await self.memory.call("POST", "/v1/memories", headers, body=body)
        except (TimeoutError, OSError, MalformedResponse) as exc:
            self.stats["summary_memory_failed"] += 1
            log.warning("summary %s: memory write failed: %s", write.request_id, exc)
            return
        if status == 201:
            self.stats["summary_memory_written"] += 1
            return
        self.stats["summary_memory_failed"] += 1
        log.warning("summary %s: memory write refused (%d): %s", write.request_id, status, answer[:200])

    async def aclose(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.memory is not None:
            self.memory.close()
        await self.redis.aclose()
