"""The worker's side of calibrated counts (docs/assembly.md "Calibrated token counts").

* ``issue`` gives a chat-native assembly an id (``assembly_id`` in the reply, unguessable) and
  buffers the service's own record of it: the org, the catalog model and the uncalibrated count
  of the emitted prompt. No I/O.
* ``submit`` takes a usage report the broker forwarded (already authorized for its org): it is
  validated and buffered. Nothing in it but the org, the assembly id and the provider's count is
  used: the model and the count the ratio is taken against come from the record.
* ``flush`` (every ``FLUSH_INTERVAL_S``, a background task) writes the buffered records, matches
  the buffered reports to records (any worker's: the broker sends a report to any worker, so the
  records live in Redis), buckets each ratio or refuses it as an outlier, and writes the samples
  to the Redis sketches, one atomic script per (org, model) (``worker.calibration_store``), each
  charged to its org's storage budget (a refused record or new sketch is counted, never stored). A
  report whose record is not there yet (its assembly was served by a worker that has not flushed)
  is looked up again on the next ``RESOLVE_FLUSHES`` flushes, then dropped as unknown and counted,
  like one naming an expired, used, forged or other org's assembly.
* ``lookup`` is what a request asks: the (org, model) calibration from this worker's copy, or
  None while the key has fewer than ``calibration_min_samples`` samples. No I/O: ``refresh``
  re-reads the keys requests asked for every ``calibration_refresh_ms``, off the request path.

Everything is keyed by (org, catalog model name), and both the record and the sample are stored
under the org the broker authorized, so one tenant's reports can only move its own budgets, and
only through assemblies the service really made for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..pipeline.budget.catalog import Catalog
from ..pipeline.counting.calibration import FALL_INTERVAL_MS, Calibration, bucket_of, decay_per_sample
from ..shared.config.observability import CalibrationMetrics
from ..shared.config.settings import WorkerSettings
from ..shared.stores.storage import StorePressure
from ..shared.wire.codec import unpack, validate
from ..shared.wire.errors import StorageQuotaExceeded
from ..shared.wire.models import AssembleResponse, ErrorReply, UsageReport
from ..shared.wire.protocol import MAX_USAGE_BYTES
from . import calibration_store as store

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (org_id, catalog model name)
FLUSH_INTERVAL_S = 0.25
MAX_ACTIVE_KEYS = 10_000  # (org, model) pairs a worker keeps a copy of (LRU)
MAX_PENDING = 50_000  # buffered reports, and buffered records; beyond this (Redis down) dropped and counted
REFRESH_BATCH = 500  # keys per Redis round trip
# Flushes a report waits for its record: the assembling worker writes its records every
# FLUSH_INTERVAL_S, so two of ours cover one of its; four leave room for a slow Redis.
RESOLVE_FLUSHES = 4
ASSEMBLY_ID = re.compile(r"[0-9a-f]{32}")  # what ``issue`` hands out: 128 random bits
# Refused reports are summed into one INFO line at most this often (one line each only at DEBUG):
# a caller's flood of bad reports must not become a flood of log lines.
REFUSAL_LOG_S = 10.0


@dataclass(slots=True)
class _Report:
    org_id: str
    assembly_id: str
    prompt_tokens: int
    tries: int = 0


class Calibrator:
    """One per worker process: usage reports in, per-(org, model) calibrations out."""

    def __init__(self, *, redis: Redis, catalog: Catalog, settings: WorkerSettings,
                 metrics: CalibrationMetrics | None = None) -> None:
        self.redis = redis
        self.catalog = catalog
        self.settings = settings
        self.pressure = StorePressure()  # the server's maxmemory, for each org's storage budget
        self.enabled = settings.calibration
        self.sketch = store.SketchPolicy(decay_per_sample(settings.calibration_window), settings.calibration_quantile,
                                         settings.calibration_min_samples, FALL_INTERVAL_MS)
        self.refresh_s = settings.calibration_refresh_ms / 1000
        self.metrics = metrics
        self.table: dict[Key, Calibration | None] = {}
        self.active: OrderedDict[Key, None] = OrderedDict()
        self.records: list[store.Record] = []
        self.reports: list[_Report] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self.refusals: collections.Counter[str] = collections.Counter()  # since the last summary line
        self.last_refusal = ""
        self.next_refusal_log = 0.0

    # ------------------------------------------------------------------------- request path

    def lookup(self, org_id: str, model: str) -> Calibration | None:
        """The key's calibration when it has enough samples, else None (the conservative rules)."""
        key = (org_id, model)
        if key in self.active:
            self.active.move_to_end(key)
        else:
            self.active[key] = None
            if len(self.active) > MAX_ACTIVE_KEYS:
                old, _ = self.active.popitem(last=False)
                self.table.pop(old, None)
        cal = self.table.get(key)
        if not self.enabled or cal is None or not cal.active(self.sketch.min_samples):
            return None
        return cal

    def issue(self, resp: AssembleResponse, *, org_id: str, model: str) -> AssembleResponse:
        """The reply with a fresh ``assembly_id``, its record buffered for the next flush. A reply
        without an uncalibrated count (not chat-native), or one the full buffer cannot record,
        gets no id: there is nothing a report could be matched to."""
        count = resp.prompt_tokens_uncalibrated
        if count is None or count < 1:
            return resp
        if len(self.records) >= MAX_PENDING:
            self._count("record_dropped")
            return resp
        assembly_id = secrets.token_hex(16)
        self.records.append((org_id, assembly_id, model, count))
        return resp.model_copy(update={"assembly_id": assembly_id})

    def submit(self, payload: bytes) -> None:
        """One forwarded usage report: validate and buffer; it is matched to its record on flush."""
        report = validate(unpack(payload, max_bytes=MAX_USAGE_BYTES), UsageReport)
        if isinstance(report, ErrorReply):
            self._refused("invalid", f"{report.message!r}")
            return
        if not ASSEMBLY_ID.fullmatch(report.assembly_id):
            self._refused("unknown_assembly", f"{report.assembly_id[:80]!r} is not an assembly id this service issues",
                          org_id=report.org_id)
            return
        if len(self.reports) >= MAX_PENDING:
            self._count("dropped_backlog")
            return
        self.reports.append(_Report(report.org_id, report.assembly_id, report.prompt_tokens))

    def _refused(self, outcome: str, why: str, **fields: str) -> None:
        """Count a refused report; it is logged one line each at DEBUG, else summed (``log_refusals``).
        ``why`` quotes caller text with ``repr``, so no report can write a line of its own."""
        self._count(outcome)
        self.refusals[outcome] += 1
        self.last_refusal = f"{outcome}: {why}"
        log.debug("usage report refused (%s): %s", outcome, why, extra=fields)

    def log_refusals(self, now_s: float) -> None:
        """One INFO line for the reports refused since the last one, at most every ``REFUSAL_LOG_S``."""
        if not self.refusals or now_s < self.next_refusal_log:
            return
        counts = ", ".join(f"{outcome} {n}" for outcome, n in sorted(self.refusals.items()))
        log.info("usage reports refused: %s (the last: %s)", counts, self.last_refusal)
        self.refusals.clear()
        self.next_refusal_log = now_s + REFUSAL_LOG_S

    def _count(self, outcome: str, n: int = 1) -> None:
        self.stats[f"usage_{outcome}"] += n
        if self.metrics is not None:
            self.metrics.reports.labels(outcome).inc(n)

    # ------------------------------------------------------------------------ background

    async def flush(self) -> None:
        """Write the buffered records, match the buffered reports, write their samples. A Redis
        failure drops that batch (counted), never retries into an ever-growing buffer."""
        records, reports = self.records, self.reports
        self.records, self.reports = [], []
        if records:
            try:
                over = await store.write_records(self.redis, records, budget=await self._budget())
            except (RedisError, OSError) as exc:
                self._count("record_write_failed", len(records))
                log.warning("writing %d assembly records failed: %s", len(records), exc)
            else:
                for org_id, n in over.items():
                    self._count("record_refused_quota", n)
                    log.info("%d assembly records of org %s refused: its storage budget (IBEX_ORG_STORAGE_BYTES) "
                             "is spent", n, org_id)
        if reports:
            await self._apply(await self._resolve(reports))

    async def _resolve(self, reports: list[_Report]) -> dict[Key, tuple[collections.Counter[int], int]]:
        """Each report's sample against its record: {(org, model): (bucket counts, refused)}."""
        try:
            found = await store.take_records(self.redis, [(r.org_id, r.assembly_id) for r in reports])
        except (RedisError, OSError) as exc:
            self._count("lookup_failed", len(reports))
            log.warning("matching %d usage reports failed: %s", len(reports), exc)
            return {}
        samples: dict[Key, tuple[collections.Counter[int], int]] = {}
        for report, record in zip(reports, found, strict=True):
            if record is None:
                report.tries += 1
                if report.tries < RESOLVE_FLUSHES:
                    self.reports.append(report)
                else:
                    self._count("unknown_assembly")
                continue
            model, count = record
            key = (report.org_id, model)
            buckets, refused = samples.get(key, (collections.Counter(), 0))
            ratio = report.prompt_tokens / count
            bucket = bucket_of(ratio)
            if bucket is None:
                self._refused("refused_outlier", f"ratio {ratio:.3f} (provider {report.prompt_tokens} / service "
                              f"{count}) is outside the sane range", org_id=report.org_id, model=model,
                              assembly_id=report.assembly_id)
                refused += 1
            else:
                self._count("accepted")
                buckets[bucket] += 1
            samples[key] = (buckets, refused)
        return samples

    async def _budget(self) -> int:
        """One org's storage budget (``shared.stores.storage``), from the server's maxmemory."""
        return self.settings.org_storage_budget((await self.pressure.read(self.redis)).limit)

    async def _apply(self, samples: dict[Key, tuple[collections.Counter[int], int]]) -> None:
        for (org_id, model), (buckets, refused) in samples.items():
            try:
                await store.apply_batch(self.redis, org_id, model, buckets, self.sketch, budget=await self._budget(),
                                        refused=refused)
            except StorageQuotaExceeded as exc:  # a new sketch the org's budget does not allow: not written
                self._count("refused_quota")
                self.last_refusal = f"refused_quota: {exc.message}"
                log.info("calibration sketch %s/%s refused: %s", org_id, model, exc.message)
            except (RedisError, OSError) as exc:
                self.stats["usage_write_failed"] += 1
                if self.metrics is not None:
                    self.metrics.reports.labels("write_failed").inc()
                log.warning("calibration write for %s/%s failed: %s", org_id, model, exc)

    async def refresh(self) -> None:
        """Re-read the sketches of every key requests asked for (batched round trips)."""
        keys = list(self.active)
        for i in range(0, len(keys), REFRESH_BATCH):
            chunk = keys[i:i + REFRESH_BATCH]
            try:
                found = await store.read_many(self.redis, chunk, quantile=self.sketch.quantile)
            except (RedisError, OSError) as exc:
                self.stats["calibration_refresh_failed"] += 1
                log.warning("calibration refresh failed: %s", exc)
                return
            self.table.update(found)
            if self.metrics is not None:
                for (org, model), cal in found.items():
                    if cal is not None:
                        self.metrics.observe(org, model, cal)
        self.stats["calibration_refreshes"] += 1

    async def run(self) -> None:
        """Flush every ``FLUSH_INTERVAL_S`` and refresh every ``calibration_refresh_ms`` until cancelled."""
        next_refresh = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if self.records or self.reports:
                await self.flush()
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + self.refresh_s
                await self.refresh()
            self.log_refusals(loop.time())
            await asyncio.sleep(min(FLUSH_INTERVAL_S, self.refresh_s))

    async def aclose(self) -> None:
        """Write what is buffered (SIGTERM drain), then close the connection."""
        try:
            await self.flush()
        finally:
            await self.redis.aclose()
