"""Compaction summaries to store (protocol SUMMARY; README "Compaction summaries").

The broker forwards a summary after it validated it whole and authorized its org and agent, exactly
as it does a usage report; it takes no credit and gets no reply. Here it is validated again (``SummaryWrite``; a bad
one is refused as a typed ``ErrorReply`` value, counted under ``summary_rejected_invalid`` and
logged, never raised), then stored under ``{org}:summary:{agent}:{summary_key}`` with a TTL,
only when its ``covers`` is greater than the stored one's: one Lua script, so two writers of the
same conversation never let an older summary replace a newer one. With ``as_memory`` it is also
written to the agent's memories through the memory service's own validated write path
(``POST /v1/memories``, the org's token, its quotas), as one ``event`` memory per conversation,
rewritten with each newer summary.

Every outcome is counted in ``stats`` (the worker's heartbeat carries them to the broker's STATUS):
``summary_stored``, ``summary_stale`` (covers not greater), ``summary_rejected_invalid``,
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

from ibex_context.shared.config.settings import WorkerSettings
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.keys import summary_key
from ibex_context.shared.stores.summaries import encode_summary
from ibex_context.shared.wire.codec import unpack, validate
from ibex_context.shared.wire.models import ErrorReply
from ibex_context.shared.wire.summary_write import MAX_SUMMARY_BYTES, SummaryWrite
from ibex_context.worker.memhttp import MalformedResponse, MemoryHTTP

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # summaries being stored at once; beyond it one is dropped and counted
MEMORY_CATEGORY = "event"

# KEYS[1] the summary's key; ARGV: the value, its covers, the TTL in seconds. 1 stored, 0 stale.
NEWER_WINS = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, doc = pcall(cjson.decode, cur)
  if ok and type(doc) == 'table' and tonumber(doc['covers']) and tonumber(doc['covers']) >= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[3]))
return 1
"""


def memory_id(summary_key_: str) -> str:
    """The one memory a conversation's summaries become (rewritten by each newer one)."""
    return "summary-" + hashlib.sha256(summary_key_.encode()).hexdigest()[:32]


def memory_text(text: str, made_at_s: float) -> str:
    """What the memory says: the summary, dated (its day, UTC)."""
    day = datetime.fromtimestamp(made_at_s, UTC).date().isoformat()
    return f"Conversation summary ({day}): {text}"


def stored_value(write: SummaryWrite, made_at_s: float) -> bytes:
    """``shared.stores.summaries``'s format, plus when it was made (ignored by readers)."""
    doc: dict[str, Any] = orjson.loads(encode_summary(write.text, write.covers))
    doc["made_at"] = made_at_s
    return orjson.dumps(doc)


class Summaries:
    """One per worker process: summaries in (``submit``, from the broker link), stored off the loop's
    request path in tasks of their own, at most ``MAX_IN_FLIGHT`` at once."""

    def __init__(self, *, redis: Redis, settings: WorkerSettings, memory: MemoryHTTP | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self.memory = memory
        self.stats: collections.Counter[str] = collections.Counter()
        self.tasks: set[asyncio.Task[bool]] = set()
        self.last_refusal: ErrorReply | None = None
        self._script = redis.register_script(NEWER_WINS)

    @classmethod
    def create(cls, settings: WorkerSettings) -> Summaries | None:
        """Its own Redis connection (generous timeouts: nobody waits on it) and memory-service pool."""
        if settings.redis_url is None:
            return None
        redis = Redis.from_url(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        memory = MemoryHTTP(settings.memory_url, max_body=64 * 1024, max_idle=2, user_agent="ibex-context-summaries")
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
        try:
            stored = await self._script(keys=[key], args=[stored_value(write, made_at), write.covers, ttl])
        except (RedisError, OSError) as exc:
            self.stats["summary_store_failed"] += 1
            log.warning("storing summary %s failed: %s", write.request_id, exc)
            return False
        if not stored:
            self.stats["summary_stale"] += 1
            return False
        self.stats["summary_stored"] += 1
        if write.as_memory and self.memory is not None:
            await self._remember(write, made_at)
        return True

    async def _remember(self, write: SummaryWrite, made_at_s: float) -> None:
        assert self.memory is not None
        body = orjson.dumps({"agent_id": write.agent_id, "memory_id": memory_id(write.summary_key),
                             "content": memory_text(write.text, made_at_s), "category": MEMORY_CATEGORY,
                             "created_at": datetime.fromtimestamp(made_at_s, UTC).isoformat()})
        token = mint_org_token(self.settings.memory_secret, write.org_id)
        request = self.memory.request_bytes("POST", "/v1/memories", f"Authorization: Bearer {token}\r\n".encode(),
                                            body=body)
        try:
            async with asyncio.timeout(self.settings.summary_memory_timeout_ms / 1000):
                status, answer = await self.memory.request(request)
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
