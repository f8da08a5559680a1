"""The worker's side of calibrated counts (README "Calibrated token counts").

* ``submit`` takes a usage report the broker forwarded (already authorized for its org): it is
  validated, its ratio bucketed or refused as an outlier, and buffered. No I/O.
* ``flush`` (every ``FLUSH_INTERVAL_S``, a background task) writes the buffered samples to the
  Redis sketches, one atomic script per (org, model) (``shared.calibration_store``).
* ``lookup`` is what a request asks: the (org, model) calibration from this worker's copy, or
  None while the key has fewer than ``calibration_min_samples`` samples. No I/O: ``refresh``
  re-reads the keys requests asked for every ``calibration_refresh_ms``, off the request path.

Everything is keyed by (org, catalog model name), and a report is stored under the org the broker
authorized, so one tenant's reports can only move its own budgets.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections import OrderedDict

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ibex_context.shared import calibration_store as store
from ibex_context.shared.calibration import Calibration, bucket_of, decay_per_sample
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.codec import unpack, validate
from ibex_context.shared.errors import UnknownModel
from ibex_context.shared.models import ErrorReply, UsageReport
from ibex_context.shared.observability import CalibrationMetrics
from ibex_context.shared.protocol import MAX_USAGE_BYTES
from ibex_context.shared.settings import WorkerSettings

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (org_id, catalog model name)
FLUSH_INTERVAL_S = 0.25
MAX_ACTIVE_KEYS = 10_000  # (org, model) pairs a worker keeps a copy of (LRU)
MAX_PENDING = 50_000  # buffered samples; beyond this (Redis down) reports are dropped and counted
REFRESH_BATCH = 500  # keys per Redis round trip


class Calibrator:
    """One per worker process: usage reports in, per-(org, model) calibrations out."""

    def __init__(self, *, redis: Redis, catalog: Catalog, settings: WorkerSettings,
                 metrics: CalibrationMetrics | None = None) -> None:
        self.redis = redis
        self.catalog = catalog
        self.enabled = settings.calibration
        self.min_samples = settings.calibration_min_samples
        self.quantile = settings.calibration_quantile
        self.refresh_s = settings.calibration_refresh_ms / 1000
        self.decay = decay_per_sample(settings.calibration_window)
        self.metrics = metrics
        self.table: dict[Key, Calibration | None] = {}
        self.active: OrderedDict[Key, None] = OrderedDict()
        self.pending: dict[Key, collections.Counter[int]] = {}
        self.pending_refused: collections.Counter[Key] = collections.Counter()
        self.pending_n = 0
        self.stats: collections.Counter[str] = collections.Counter()

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
        if not self.enabled or cal is None or not cal.active(self.min_samples):
            return None
        return cal

    def submit(self, payload: bytes) -> None:
        """One forwarded usage report: validate, bucket (or refuse as an outlier), buffer."""
        report = validate(unpack(payload, max_bytes=MAX_USAGE_BYTES), UsageReport)
        if isinstance(report, ErrorReply):
            self._count("invalid")
            log.info("usage report refused: %s", report.message)
            return
        try:
            model = self.catalog.model(report.model).name
        except UnknownModel:
            self._count("unknown_model")
            log.info("usage report refused: model %r is not in the catalog", report.model)
            return
        if self.pending_n >= MAX_PENDING:
            self._count("dropped_backlog")
            return
        key = (report.org_id, model)
        ratio = report.prompt_tokens / report.estimated_tokens
        bucket = bucket_of(ratio)
        self.pending_n += 1
        if bucket is None:
            self.pending_refused[key] += 1
            self._count("refused_outlier")
            log.info("usage report refused: ratio %.3f (provider %d / estimate %d) is outside the sane range",
                     ratio, report.prompt_tokens, report.estimated_tokens,
                     extra={"org_id": report.org_id, "model": model, "assembly_id": report.assembly_id})
            return
        self.pending.setdefault(key, collections.Counter())[bucket] += 1
        self._count("accepted")

    def _count(self, outcome: str) -> None:
        self.stats[f"usage_{outcome}"] += 1
        if self.metrics is not None:
            self.metrics.reports.labels(outcome).inc()

    # ------------------------------------------------------------------------ background

    async def flush(self) -> None:
        """Write the buffered samples; a Redis failure drops that batch (counted), never retries
        into an ever-growing buffer."""
        pending, refused = self.pending, self.pending_refused
        self.pending, self.pending_refused, self.pending_n = {}, collections.Counter(), 0
        for key in set(pending) | set(refused):
            try:
                await store.apply_batch(self.redis, key[0], key[1], pending.get(key, {}), decay=self.decay,
                                        refused=refused.get(key, 0))
            except (RedisError, OSError) as exc:
                self.stats["usage_write_failed"] += 1
                if self.metrics is not None:
                    self.metrics.reports.labels("write_failed").inc()
                log.warning("calibration write for %s/%s failed: %s", key[0], key[1], exc)

    async def refresh(self) -> None:
        """Re-read the sketches of every key requests asked for (batched round trips)."""
        keys = list(self.active)
        for i in range(0, len(keys), REFRESH_BATCH):
            chunk = keys[i:i + REFRESH_BATCH]
            try:
                found = await store.read_many(self.redis, chunk, quantile=self.quantile)
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
            if self.pending or self.pending_refused:
                await self.flush()
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + self.refresh_s
                await self.refresh()
            await asyncio.sleep(min(FLUSH_INTERVAL_S, self.refresh_s))

    async def aclose(self) -> None:
        """Write what is buffered (SIGTERM drain), then close the connection."""
        try:
            await self.flush()
        finally:
            await self.redis.aclose()
