"""Calibration in Redis: one HASH per (org, model) (``shared.stores.keys.calibration_key``) and one short-lived
STRING per assembly a usage report may name (``shared.stores.keys.assembly_key``).

The sketch:

    b:<bucket>   float   decayed weight of the ratio bucket (``pipeline.calibration``)
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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ibex_context.pipeline.calibration import (
    MAX_FALL_BUCKETS,
    N_BUCKETS,
    UNCALIBRATED_BUCKET,
    Calibration,
    summarize,
    upper_edge,
)
from ibex_context.shared.stores.keys import assembly_key, calibration_key, check_ident

PRUNE_BELOW = 1e-3
TTL_S = 30 * 24 * 3600  # a month without reports and the key is gone
# How long after its assembly a report is still matched: the provider call in between may be a
# long generation; later than this the report is dropped as unknown.
RECORD_TTL_S = 15 * 60
DEFAULT_QUANTILE = 0.995  # IBEX_CALIBRATION_QUANTILE's default

# KEYS[1] the sketch; ARGV[1] decay factor for the whole batch; ARGV[2] prune threshold;
# ARGV[3] accepted count; ARGV[4] refused count; ARGV[5] ttl; ARGV[6] quantile; ARGV[7] min
# samples before the served bucket may fall; ARGV[8] most buckets one fall may take; ARGV[9] ms
# between falls (0: every call may fall); ARGV[10] the served bucket of a new key; then
# (bucket, weight) pairs.
_APPLY_LUA = """
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE calibration key is not a hash')
end
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
for j = 11, #ARGV, 2 do
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


async def apply_batch(redis: Redis, org_id: str, model: str, buckets: Mapping[int, int], policy: SketchPolicy, *,
                      refused: int = 0) -> None:
    """Add a batch of samples (bucket -> count) to one key, decaying what was there by the batch size,
    and move its served bucket (bounded: module docstring)."""
    key = calibration_key(org_id, model)
    k = sum(buckets.values())
    args: list[Any] = [repr(policy.decay ** k), repr(PRUNE_BELOW), k, refused, TTL_S, repr(policy.quantile),
                       repr(policy.min_samples), MAX_FALL_BUCKETS, int(policy.fall_interval_ms), UNCALIBRATED_BUCKET]
    for bucket, count in sorted(buckets.items()):
        args += [bucket, count]
    await redis.eval(_APPLY_LUA, 1, key, *args)


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
    prefix = f"{check_ident(org_id, 'org_id')}:calibration:"
    found = [key.decode(errors="replace")[len(prefix):]
             async for key in redis.scan_iter(match=prefix + "*", count=500)]
    return sorted(found)


# ----------------------------------------------------------------------------- assembly records

Record = tuple[str, str, str, int]  # (org_id, assembly_id, catalog model, uncalibrated prompt count)


async def write_records(redis: Redis, records: Sequence[Record]) -> None:
    """Store a batch of assembly records (one round trip), each expiring after ``RECORD_TTL_S``."""
    pipe = redis.pipeline(transaction=False)
    for org_id, assembly_id, model, count in records:
        pipe.set(assembly_key(org_id, assembly_id), f"{int(count)}:{check_ident(model, 'model')}", ex=RECORD_TTL_S)
    await pipe.execute()


async def take_records(redis: Redis, wanted: Sequence[tuple[str, str]]) -> list[tuple[str, int] | None]:
    """Each (org_id, assembly_id)'s (model, uncalibrated count), deleted as it is read (a record
    serves one report); None where there is none (never issued, expired, used, another org's)."""
    pipe = redis.pipeline(transaction=False)
    for org_id, assembly_id in wanted:
        pipe.getdel(assembly_key(org_id, assembly_id))
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
