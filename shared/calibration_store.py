"""The calibration sketch in Redis: one HASH per (org, model) (``shared.keys.calibration_key``).

    b:<bucket>   float   decayed weight of the ratio bucket (``shared.calibration``)
    n            int     reports accepted, lifetime
    refused      int     reports refused as outliers, lifetime

A batch of samples is applied by one Lua script, atomically: every stored weight is multiplied
by ``decay ** k`` (k new samples), weights under ``PRUNE_BELOW`` are deleted, then the new
samples are added. So the hash never holds more than ``N_BUCKETS`` + 2 fields, and a key nobody
reports to expires after ``TTL_S``. Workers batch reports and call ``apply_batch`` off the request
path; ``read`` serves the workers' refresh and ``ibex-context calibration show``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis

from ibex_context.shared.calibration import Calibration, summarize
from ibex_context.shared.keys import calibration_key, check_ident

PRUNE_BELOW = 1e-3
TTL_S = 30 * 24 * 3600  # a month without reports and the key is gone

# KEYS[1] the sketch; ARGV[1] decay factor for the whole batch; ARGV[2] prune threshold;
# ARGV[3] accepted count; ARGV[4] refused count; ARGV[5] ttl; then (bucket, weight) pairs.
_APPLY_LUA = """
local decay = tonumber(ARGV[1])
local prune = tonumber(ARGV[2])
if redis.call('TYPE', KEYS[1])['ok'] ~= 'none' and redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then
  return redis.error_reply('WRONGTYPE calibration key is not a hash')
end
if decay < 1 then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    local f = all[j]
    if string.sub(f, 1, 2) == 'b:' then
      local w = tonumber(all[j + 1]) * decay
      if w < prune then redis.call('HDEL', KEYS[1], f) else redis.call('HSET', KEYS[1], f, tostring(w)) end
    end
  end
end
for j = 6, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], 'b:' .. ARGV[j], ARGV[j + 1])
end
if tonumber(ARGV[3]) > 0 then redis.call('HINCRBY', KEYS[1], 'n', ARGV[3]) end
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', KEYS[1], 'refused', ARGV[4]) end
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


async def apply_batch(redis: Redis, org_id: str, model: str, buckets: Mapping[int, int], *, decay: float,
                      refused: int = 0) -> None:
    """Add a batch of samples (bucket -> count) to one key, decaying what was there by the batch size."""
    key = calibration_key(org_id, model)
    k = sum(buckets.values())
    args: list[Any] = [repr(decay ** k), repr(PRUNE_BELOW), k, refused, TTL_S]
    for bucket, count in sorted(buckets.items()):
        args += [bucket, count]
    await redis.eval(_APPLY_LUA, 1, key, *args)


def parse(raw: Mapping[Any, Any], *, quantile: float) -> Calibration | None:
    """A stored hash as a ``Calibration`` (None when it holds no sample); unreadable fields are skipped."""
    buckets: dict[int, float] = {}
    counts = {"n": 0, "refused": 0}
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
    if cal is None and counts["refused"]:
        return Calibration(0.0, quantile, 0.0, 0.0, 0.0, counts["n"], counts["refused"])
    return cal


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
