"""Calibration in Redis: one HASH per (org, model) (``shared.stores.keys.calibration_key``) and one short-lived
STRING per assembly a usage report may name (``shared.stores.keys.assembly_key``).

The sketch:

    b:<bucket>   float   decayed weight of the ratio bucket (``pipeline.counting.calibration``)
    n            int     reports accepted, lifetime
    refused      int     reports refused as outliers, lifetime
    s            int     the served bucket: the multiplier the key charges (bounded change)
    t            int     Redis time (ms) of the served bucket's last fall

A batch of samples is applied by one Lua script, atomically: every stored weight is multiplied
by ``decay ** k`` (k new samples), weights under ``PRUNE_BELOW`` are deleted, the new samples are
added, then the served bucket follows the new quantile: up at once, down by at most
``MAX_FALL_BUCKETS`` and at most once per ``fall_interval_ms`` (Redis's clock, one for every
worker), and only once the key holds ``min_samples``. So the hash never holds more than
``N_BUCKETS`` + 4 fields, and a key nobody reports to expires after ``TTL_S``. Workers batch
reports and call ``apply_batch`` off the request path; ``read`` serves the workers' refresh and
``ibex-context calibration show``.

An assembly record, ``"<uncalibrated count>:<catalog model>"``, is written by the worker that
assembled (``write_records``, batched) and read once by whichever worker gets the report
(``take_records``: GETDEL, so one assembly is one sample); it expires after ``RECORD_TTL_S``.

Sketches and records are charged to their org's storage budget (``shared.stores.storage``) in the
script that writes them: a new sketch or a batch of records the budget does not allow is not
written (``StorageQuotaExceeded``, or the refused count), and a record taken is credited back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ..pipeline.counting.calibration import (
    MAX_FALL_BUCKETS,
    N_BUCKETS,
    UNCALIBRATED_BUCKET,
    Calibration,
    summarize,
    upper_edge,
)
from ..shared.stores import storage
from ..shared.stores.keys import assembly_key, calibration_key, check_ident, org_prefix, org_storage_key
from ..shared.stores.storage import LEDGER_LUA

PRUNE_BELOW = 1e-3
TTL_S = 30 * 24 * 3600  # a month without reports and the key is gone
# How long after its assembly a report is still matched: the provider call in between may be a
# long generation; later than this the report is dropped as unknown.
RECORD_TTL_S = 15 * 60
DEFAULT_QUANTILE = 0.995  # IBEX_CALIBRATION_QUANTILE's default

# KEYS[1] the sketch; ARGV[1] decay factor for the whole batch; ARGV[2] prune threshold;
# ARGV[3] accepted count; ARGV[4] refused count; ARGV[5] ttl; ARGV[6] quantile; ARGV[7] min
# samples before the served bucket may fall; ARGV[8] most buckets one fall may take; ARGV[9] ms
# between falls (0: every call may fall); ARGV[10] the served bucket of a new key; ARGV[11] the org's
# storage budget; ARGV[12], ARGV[13], ARGV[14] the sketch's charge: base bytes, bytes a field, most
# fields; then (bucket, weight) pairs. KEYS[2] the org's storage ledger (shared.stores.storage):
# the sketch is charged for the fields it may hold after the batch, in the bucket of its new expiry,
# and its previous charge (field ``q``) credited; a new sketch over the budget is not written
# (the script returns the ledger's refusal, a negative number).
_APPLY_LUA = LEDGER_LUA + """
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE calibration key is not a hash')
end
local fields = redis.call('HLEN', key) + (#ARGV - 14) / 2 + 5
local q = tonumber(ARGV[12]) + tonumber(ARGV[13]) * math.min(fields, tonumber(ARGV[14]))
local old_q = tonumber(redis.call('HGET', key, 'q') or '0') or 0
local old_b = 0
if old_q > 0 then old_b = bucket_of(redis.call('PEXPIRETIME', key)) end
local total = charge(KEYS[2], tonumber(ARGV[11]), q, bucket_of((now_s() + tonumber(ARGV[5])) * 1000), old_q, old_b,
                     old_q > 0)
if total < 0 then return total end
local decay = tonumber(ARGV[1])
local prune = tonumber(ARGV[2])
if decay < 1 then
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    local f = all[j]
    if string.sub(f, 1, 2) == 'b:' then
      local w = tonumber(all[j + 1]) * decay
      if w < prune then redis.call('HDEL', key, f) else redis.call('HSET', key, f, tostring(w)) end
    end
  end
end
for j = 15, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', key, 'b:' .. ARGV[j], ARGV[j + 1])
end
if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', key, 'n', ARGV[3]) end
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', key, 'refused', ARGV[4]) end
local idx, weight, total = {}, {}, 0
local all = redis.call('HGETALL', key)
for j = 1, #all, 2 do
  if string.sub(all[j], 1, 2) == 'b:' then
    local i, w = tonumber(string.sub(all[j], 3)), tonumber(all[j + 1])
    if i and w and w > 0 then idx[#idx + 1] = i; weight[i] = w; total = total + w end
  end
end
if #idx > 0 then
  table.sort(idx)
  local need, seen, q = tonumber(ARGV[6]) * total, 0, idx[#idx]
  for _, i in ipairs(idx) do
    seen = seen + weight[i]
    if seen >= need then q = i; break end
  end
  local s = tonumber(redis.call('HGET', key, 's') or ARGV[10]) or tonumber(ARGV[10])
  if q > s then
    s = q
  elseif q < s and total >= tonumber(ARGV[7]) then
    local interval = tonumber(ARGV[9])
    local now, may = 0, true
    if interval > 0 then
      local clock = redis.call('TIME')
      now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
      may = now - (tonumber(redis.call('HGET', key, 't') or '0') or 0) >= interval
    end
    if may then
      s = math.max(q, s - tonumber(ARGV[8]))
      if interval > 0 then redis.call('HSET', key, 't', string.format('%d', now)) end
    end
  end
  redis.call('HSET', key, 's', string.format('%d', s))
end
redis.call('HSET', key, 'q', string.format('%d', q))
redis.call('EXPIRE', key, ARGV[5])
return 1
"""


@dataclass(frozen=True, slots=True)
class SketchPolicy:
    """How a batch moves a sketch (module docstring): each sample decays what was there by ``decay``;
    the served bucket follows the ``quantile``, and falls only once the key holds ``min_samples``
    and at most once per ``fall_interval_ms`` (0: any batch may lower it)."""

    decay: float
    quantile: float = DEFAULT_QUANTILE
    min_samples: float = 0.0
    fall_interval_ms: int = 0


_SKETCH_FIELDS = N_BUCKETS + 5  # b:<i> for every bucket, n, refused, s, t, q
_SKETCH_FIELD_BYTES = storage.FIELD_BYTES + 2 * storage.alloc(24 + 9)  # a name and a float's text
_SKETCH_BASE_BYTES = storage.KEY_BYTES + storage.HASH_BYTES


def sketch_charge(key: str, fields: int = _SKETCH_FIELDS) -> int:
    """The bytes a sketch holding ``fields`` fields is charged (every field as a float's text)."""
    return _SKETCH_BASE_BYTES + storage.alloc(len(key) + 9) + _SKETCH_FIELD_BYTES * min(fields, _SKETCH_FIELDS)


async def apply_batch(redis: Redis, org_id: str, model: str, buckets: Mapping[int, int], policy: SketchPolicy, *,
                      budget: int | None = None, refused: int = 0) -> None:
    """Add a batch of samples (bucket -> count) to one key, decaying what was there by the batch size,
    and move its served bucket (bounded: module docstring). A new sketch the org's storage
    ``budget`` does not allow raises ``StorageQuotaExceeded`` and nothing is written (``None``:
    charged, never refused: an operator's tools)."""
    key = calibration_key(org_id, model)
    k = sum(buckets.values())
    args: list[Any] = [repr(policy.decay ** k), repr(PRUNE_BELOW), k, refused, TTL_S, repr(policy.quantile),
                       repr(policy.min_samples), MAX_FALL_BUCKETS, int(policy.fall_interval_ms), UNCALIBRATED_BUCKET,
                       storage.UNLIMITED if budget is None else budget, sketch_charge(key, 0), _SKETCH_FIELD_BYTES,
                       _SKETCH_FIELDS]
    for bucket, count in sorted(buckets.items()):
        args += [bucket, count]
    done = int(await redis.eval(_APPLY_LUA, 2, key, org_storage_key(org_id), *args))
    if done < 0:
        raise storage.refused(org_id, -done - 1, sketch_charge(key), storage.UNLIMITED if budget is None else budget,
                              f"calibration sketch {model}")


def parse(raw: Mapping[Any, Any], *, quantile: float) -> Calibration | None:
    """A stored hash as a ``Calibration`` (None when it holds no sample); unreadable fields are skipped."""
    buckets: dict[int, float] = {}
    counts = {"n": 0, "refused": 0, "s": -1}
    for field, value in raw.items():
        name = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
        try:
            if name.startswith("b:"):
                buckets[int(name[2:])] = float(value)
            elif name in counts:
                counts[name] = int(value)
        except ValueError:
            continue
    cal = summarize(buckets, quantile=quantile, accepted=counts["n"], refused=counts["refused"])
    if cal is None:
        if counts["refused"]:
            return Calibration(0.0, quantile, 0.0, 0.0, 0.0, counts["n"], counts["refused"])
        return None
    # A hash no script has bounded yet charges no less than the catalog's rule.
    served = (upper_edge(min(counts["s"], N_BUCKETS - 1)) if counts["s"] >= 0
              else max(cal.ratio, upper_edge(UNCALIBRATED_BUCKET)))
    return Calibration(cal.samples, quantile, cal.ratio, cal.median, cal.top, cal.accepted, cal.refused, served)


async def read(redis: Redis, org_id: str, model: str, *, quantile: float) -> Calibration | None:
    raw = await redis.hgetall(calibration_key(org_id, model))
    return parse(raw, quantile=quantile)


async def read_many(redis: Redis, keys: list[tuple[str, str]], *, quantile: float) -> dict[tuple[str, str],
                                                                                       Calibration | None]:
    """Several keys in one round trip (the workers' refresh)."""
    pipe = redis.pipeline(transaction=False)
    for org_id, model in keys:
        pipe.hgetall(calibration_key(org_id, model))
    raws = await pipe.execute()
    return {k: parse(raw, quantile=quantile) for k, raw in zip(keys, raws, strict=True)}


async def models_of(redis: Redis, org_id: str) -> list[str]:
    """The models one org has a sketch for (SCAN over its own prefix only)."""
    prefix = org_prefix(org_id) + "calibration:"
    found = [key.decode(errors="replace")[len(prefix):]
             async for key in redis.scan_iter(match=prefix + "*", count=500)]
    return sorted(found)


# ----------------------------------------------------------------------------- assembly records

Record = tuple[str, str, str, int]  # (org_id, assembly_id, catalog model, uncalibrated prompt count)


_RECORD_VALUE_MAX = 20 + 1 + 64  # "<count>:<model>": a count and an identifier


def record_charge(key: str) -> int:
    """The bytes one assembly record is charged (its value at its longest)."""
    return storage.string_cost(len(key), _RECORD_VALUE_MAX)


# KEYS[1] the org's ledger, then the records' keys; ARGV[1] the budget, ARGV[2] the TTL, then per
# record its value and charge. All of one org's records of a batch are charged (to the bucket of their
# expiry) and written, or none: the ledger's refusal (a negative number) is returned.
_WRITE_RECORDS_LUA = LEDGER_LUA + """
local amount = 0
for j = 2, #KEYS do amount = amount + tonumber(ARGV[2 * j]) end
local ttl = tonumber(ARGV[2])
local total = charge(KEYS[1], tonumber(ARGV[1]), amount, bucket_of((now_s() + ttl) * 1000), 0, 0, false)
if total < 0 then return total end
for j = 2, #KEYS do redis.call('SET', KEYS[j], ARGV[2 * j - 1], 'EX', ttl) end
return #KEYS - 1
"""

# KEYS[1] a record, KEYS[2] its org's ledger; ARGV[1] its charge, credited when the record was there.
_TAKE_RECORD_LUA = LEDGER_LUA + """
local expires = redis.call('PEXPIRETIME', KEYS[1])
local v = redis.call('GETDEL', KEYS[1])
if v then charge(KEYS[2], 0, 0, 0, tonumber(ARGV[1]), bucket_of(expires), true) end
return v
"""


async def write_records(redis: Redis, records: Sequence[Record], *, budget: int | None = None) -> dict[str, int]:
    """Store a batch of assembly records (one round trip), each expiring after ``RECORD_TTL_S`` and
    charged to its org's storage ``budget`` (``None``: never refused); returns the records refused
    per org (not stored)."""
    by_org: dict[str, list[Record]] = {}
    for rec in records:
        by_org.setdefault(rec[0], []).append(rec)
    pipe = redis.pipeline(transaction=False)
    for org_id, recs in by_org.items():
        keys = [assembly_key(org_id, assembly_id) for _, assembly_id, _, _ in recs]
        args: list[Any] = [storage.UNLIMITED if budget is None else budget, RECORD_TTL_S]
        for key, (_, _, model, count) in zip(keys, recs, strict=True):
            args += [f"{int(count)}:{check_ident(model, 'model')}", record_charge(key)]
        pipe.eval(_WRITE_RECORDS_LUA, 1 + len(keys), org_storage_key(org_id), *keys, *args)
    done = await pipe.execute()
    return {org_id: len(recs) for (org_id, recs), n in zip(by_org.items(), done, strict=True) if int(n) < 0}


async def take_records(redis: Redis, wanted: Sequence[tuple[str, str]]) -> list[tuple[str, int] | None]:
    """Each (org_id, assembly_id)'s (model, uncalibrated count), deleted as it is read (a record
    serves one report, and its charge is credited back); None where there is none (never issued,
    expired, used, another org's)."""
    pipe = redis.pipeline(transaction=False)
    for org_id, assembly_id in wanted:
        key = assembly_key(org_id, assembly_id)
        pipe.eval(_TAKE_RECORD_LUA, 2, key, org_storage_key(org_id), record_charge(key))
    return [_record(raw) for raw in await pipe.execute()]


def _record(raw: Any) -> tuple[str, int] | None:
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    count, _, model = text.partition(":")
    try:
        n = int(count)
    except ValueError:
        return None
    return (model, n) if n > 0 and model else None
