"""Per-org storage budgets in Redis bytes: what one org's data really costs the store, charged
before it is written (docs/security.md "Storage budgets").

**What a write is charged.** An estimate of what Redis holds for it, never less than measured
(``python -m bench.storage_cost`` prints both for tiny, normal, distinct-word and large texts):

* a memory: its hash (every field, the allocator's rounding, the dict entries), its id in the
  agent's id set and hot list, and its share of the org's index: a document entry, the tag and
  numeric entries, the HNSW graph's copy of the vector and its links, and for the full text
  ``TERM_BYTES`` per distinct word (charged as if the word were new to the index, where the
  engine allocates a term, its inverted list and a first block; with English stemming a word
  can be two terms) plus ``TOKEN_BYTES`` per word occurrence (postings and offsets);
* a string (a summary, an assembly record) or a calibration sketch: its key, value and fields.

**The ledger.** One HASH per org, ``{org}:storage`` (``shared.stores.keys.org_storage_key``):

    total    int   bytes charged and not yet released
    ix       "1"   the org's index is charged (``INDEX_BYTES``, with its first memory)
    first    int   the earliest live expiry bucket (epoch seconds), absent when none
    e:<T>    int   bytes charged to keys that expire by T (epoch seconds, a multiple of BUCKET_S)

A key with a TTL (summaries, calibration sketches, assembly records) is charged to the bucket of
its expiry, rounded up to ``BUCKET_S``: when the bucket's time passes the next charge of the org
releases it, so data Redis expired stops counting within ``BUCKET_S``. Memories never expire and
count in ``total`` only. Every charge goes through ``LEDGER_LUA``'s ``charge`` function, inside
the script that writes (summaries, calibration) or just before the write (memories: the ledger is
the org's key and a memory is in its agent's hash slot, so a memory write reserves its charge,
writes, then credits back what the write replaced, or the whole charge if the write failed).
Each stored item carries what it was charged (a memory's ``q`` field, a summary's ``charge``, a
sketch's ``q``), so a rewrite credits exactly that; items stored before budgets existed carry
none and credit nothing.

**The budget.** ``org_budget``: ``IBEX_ORG_STORAGE_BYTES`` if set, else
``IBEX_ORG_STORAGE_FRACTION`` (0.25) of the server's ``maxmemory`` (1 GiB when Redis has none),
never more than that fraction when both are known. Over it a write is refused with
``StorageQuotaExceeded`` naming the setting, before anything is stored.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from ..wire.errors import StorageQuotaExceeded
from .keys import org_storage_key

__all__ = ["BUCKET_S", "LEDGER_LUA", "StorageQuotaExceeded", "StorePressure", "alloc", "hash_cost", "memory_cost",
           "org_budget", "string_cost"]

BUCKET_S = 3600  # expiry buckets of the ledger: TTL'd data stops counting at most this long after it expired
DEFAULT_FRACTION = 0.25  # IBEX_ORG_STORAGE_FRACTION's default
NO_MAXMEMORY_BUDGET = 1 << 30  # the budget when Redis has no maxmemory and none is set
UNLIMITED = 1 << 62  # the budget of a charge that is counted but never refused
STORE_INFO_TTL_S = 1.0  # INFO memory is read at most this often per process

# Measured on the embedded Redis 8.2 with the query engine (bench.storage_cost), then rounded up:
KEY_BYTES = 96  # a key in the keyspace: dict entry, robj, expiry entry, key sds
FIELD_BYTES = 16  # per hash field, besides the allocations of its name and value
HASH_BYTES = 96  # a hash table's own structures
SET_MEMBER_BYTES = 48  # a member of a set or sorted set, besides its string
DOC_BYTES = 256  # per indexed document: doc table, key table, tag, numeric and sort entries
HNSW_NODE_BYTES = 384  # per vector in the HNSW graph besides its copy of the vector: links, level data
TERM_BYTES = 600  # per distinct word: a new term (trie node, inverted list, first block) and its stem
INDEX_BYTES = 2_100_000  # an org's index and its first memory's graph block: charged with its first memory
TOKEN_BYTES = 6  # per word occurrence: postings, frequency and offsets
_WORD = re.compile(r"\w+", re.UNICODE)


def alloc(n: int) -> int:
    """The bytes jemalloc hands out for an ``n``-byte request (its size classes: four per doubling)."""
    if n <= 8:
        return 8
    if n <= 128:
        return (n + 15) // 16 * 16
    step = 1 << (max(n - 1, 1).bit_length() - 3)
    return (n + step - 1) // step * step


def string_cost(key_len: int, value_len: int) -> int:
    """A STRING key with a TTL: keyspace entry, key and value."""
    return KEY_BYTES + alloc(key_len + 9) + alloc(value_len + 9)


def hash_cost(key_len: int, fields: dict[str, int]) -> int:
    """A HASH key (field name -> value length), as a hash table: each field's name and value apart."""
    return (KEY_BYTES + alloc(key_len + 9) + HASH_BYTES
            + sum(FIELD_BYTES + alloc(len(name) + 9) + alloc(size + 9) for name, size in fields.items()))


@dataclass(frozen=True, slots=True)
class TextCost:
    """What the full-text index holds for one text: its distinct words and its words."""

    distinct: int
    tokens: int


def text_cost(text: str) -> TextCost:
    """The words of ``text`` as the engine's tokenizer sees them (case-folded runs of word characters)."""
    words = _WORD.findall(text.lower())
    return TextCost(len(set(words)), len(words))


def memory_cost(key: str, fields: dict[str, int], text: str, *, vector_bytes: int, id_len: int, hot: bool) -> int:
    """The bytes one memory is charged: its hash (``fields``: name -> value length, the vector's
    included), its id in the agent's set and hot list, and its index entries (module docstring)."""
    words = text_cost(text)
    members = alloc(id_len + 9) + SET_MEMBER_BYTES
    return (hash_cost(len(key), fields) + members * (2 if hot else 1) + DOC_BYTES
            + alloc(vector_bytes) + HNSW_NODE_BYTES + TERM_BYTES * words.distinct + TOKEN_BYTES * words.tokens)


def org_budget(explicit: int | None, fraction: float, maxmemory: int) -> int:
    """An org's storage budget in bytes (module docstring "The budget")."""
    share = int(fraction * maxmemory) if maxmemory > 0 else None
    if explicit:
        return min(explicit, share) if share is not None else explicit
    return share if share is not None else NO_MAXMEMORY_BUDGET


@dataclass(slots=True)
class StorePressure:
    """The store's memory use and ``maxmemory``, read at most once per ``STORE_INFO_TTL_S``."""

    used: int = 0
    limit: int = 0
    read_at: float = -1e9

    async def read(self, redis: Redis, *, now: float | None = None) -> StorePressure:
        now = time.monotonic() if now is None else now
        if now - self.read_at >= STORE_INFO_TTL_S:
            info = await redis.info("memory")
            self.used, self.limit, self.read_at = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), now
        return self

    def over(self, fraction: float) -> bool:
        """True when Redis has a ``maxmemory`` and uses at least ``fraction`` of it."""
        return self.limit > 0 and self.used >= fraction * self.limit


# The ledger's one function, prepended to every script that charges (module docstring).
# charge(ledger, budget, amount, bucket, credit, credit_bucket, force) -> total, or -total when
# refused: releases the buckets whose time has passed, credits ``credit`` from ``credit_bucket``
# (0: the non-expiring part; a passed bucket was released already), then adds ``amount`` to
# ``bucket`` (0: non-expiring) unless the total would pass ``budget`` and ``force`` is false.
LEDGER_LUA = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1])
end
local function charge(ledger, budget, amount, bucket, credit, cbucket, force)
  local now = now_s()
  local total = tonumber(redis.call('HGET', ledger, 'total') or '0')
  local first = tonumber(redis.call('HGET', ledger, 'first') or '0')
  if first > 0 and first <= now then
    local all = redis.call('HGETALL', ledger)
    local nfirst = 0
    for j = 1, #all, 2 do
      if string.sub(all[j], 1, 2) == 'e:' then
        local t = tonumber(string.sub(all[j], 3))
        if t <= now then
          total = total - tonumber(all[j + 1])
          redis.call('HDEL', ledger, all[j])
        elseif nfirst == 0 or t < nfirst then
          nfirst = t
        end
      end
    end
    if nfirst > 0 then redis.call('HSET', ledger, 'first', nfirst) else redis.call('HDEL', ledger, 'first') end
  end
  if credit > 0 then
    if cbucket == 0 then
      total = total - credit
    elseif cbucket > now then
      local left = redis.call('HINCRBY', ledger, 'e:' .. cbucket, -credit)
      if left <= 0 then redis.call('HDEL', ledger, 'e:' .. cbucket); credit = credit + left end
      total = total - credit
    end
  end
  if total < 0 then total = 0 end
  if amount > 0 and not force and total + amount > budget then
    redis.call('HSET', ledger, 'total', total)
    return -total - 1
  end
  total = total + amount
  if amount ~= 0 and bucket > 0 then
    redis.call('HINCRBY', ledger, 'e:' .. bucket, amount)
    local f = tonumber(redis.call('HGET', ledger, 'first') or '0')
    if f == 0 or bucket < f then redis.call('HSET', ledger, 'first', bucket) end
  end
  redis.call('HSET', ledger, 'total', total)
  return total
end
local function bucket_of(expires_ms)
  if expires_ms < 0 then return 0 end
  return math.ceil(expires_ms / 1000 / """ + str(BUCKET_S) + """) * """ + str(BUCKET_S) + """
end
"""

# KEYS[1] the ledger; ARGV budget, amount, credit, force (0/1), and the org's index charge, added
# to the amount while the ledger has no ``ix`` field (then set): non-expiring charges (memories).
_CHARGE_LUA = LEDGER_LUA + """
local amount, first = tonumber(ARGV[2]), false
if tonumber(ARGV[5] or '0') > 0 and redis.call('HEXISTS', KEYS[1], 'ix') == 0 then
  amount, first = amount + tonumber(ARGV[5]), true
end
local total = charge(KEYS[1], tonumber(ARGV[1]), amount, 0, tonumber(ARGV[3]), 0, ARGV[4] == '1')
if first and total >= 0 then redis.call('HSET', KEYS[1], 'ix', '1') end
return total
"""


def refused(org_id: str, total: int, amount: int, budget: int, what: str) -> StorageQuotaExceeded:
    """The typed refusal for a write of ``amount`` bytes the org's budget does not allow."""
    return StorageQuotaExceeded(
        f"{what}: the org's data would take {total + amount:,} bytes of Redis memory (it holds {total:,}, this "
        f"write {amount:,}); its budget is {budget:,} (IBEX_ORG_STORAGE_BYTES, IBEX_ORG_STORAGE_FRACTION of "
        "maxmemory)", field="IBEX_ORG_STORAGE_BYTES", org_id=org_id)


async def reserve(redis: Redis, org_id: str, amount: int, budget: int, *, what: str, replacing: int = 0,
                  index: int = 0) -> None:
    """Charge ``amount`` non-expiring bytes to the org, less ``replacing`` (what the item it
    rewrites was charged), plus ``index`` (the org's index) on its first charge, or raise
    ``StorageQuotaExceeded`` and charge nothing."""
    total = int(await redis.eval(_CHARGE_LUA, 1, org_storage_key(org_id), budget, amount, replacing, 0, index))
    if total < 0:
        raise refused(org_id, -total - 1 + replacing, amount - replacing, budget, what)


async def credit(redis: Redis, org_id: str, amount: int) -> None:
    """Release ``amount`` non-expiring bytes (negative: charge them, never refused): a rewrite's
    old charge, a failed write's reservation, the difference to what a reservation assumed."""
    if amount > 0:
        await redis.eval(_CHARGE_LUA, 1, org_storage_key(org_id), 0, 0, amount, 1)
    elif amount < 0:
        await force_charge(redis, org_id, -amount)


async def force_charge(redis: Redis, org_id: str, amount: int) -> None:
    """Charge without a check (an operator's seeding): the bytes are counted, never refused."""
    if amount > 0:
        await redis.eval(_CHARGE_LUA, 1, org_storage_key(org_id), 0, amount, 0, 1)


async def usage(redis: Redis, org_id: str) -> int:
    """The bytes the org is charged now (expired buckets released)."""
    return int(await redis.eval(_CHARGE_LUA, 1, org_storage_key(org_id), 0, 0, 0, 1))
