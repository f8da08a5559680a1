"""Metrics (prometheus-client) and structured logs shared by broker, workers and the memory service.

Workers run in Prometheus multiprocess mode: each writes its samples to files under
``PROMETHEUS_MULTIPROC_DIR`` (set by ``ibex-context up`` to ``.run/prometheus``), and the broker's
metrics endpoint (``IBEX_METRICS_PORT``) serves the broker's own registry plus the aggregate of
every worker on the host. On a worker-only host, ``python -m ibex_context.shared.config.observability --port N``
serves the aggregate alone.

Logs: ``IBEX_LOG_FORMAT=json`` gives one JSON object per line with any ``extra`` fields
(request_id, org_id, timings); the default is human-readable text with the same fields appended.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

# Latency buckets (seconds) around a 40 ms deadline.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
           0.1, 0.25, 0.5, 1.0)


class _Formatter(logging.Formatter):
    def __init__(self, *, as_json: bool, process_name: str) -> None:
        super().__init__()
        self.as_json = as_json
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if self.as_json:
            doc: dict[str, Any] = {
                "ts": round(record.created, 6), "level": record.levelname, "proc": self.process_name,
                "pid": record.process, "logger": record.name, "msg": record.getMessage(), **extra,
            }
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str, separators=(",", ":"))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in extra.items())
        line = f"{stamp} {record.levelname} {self.process_name}[{record.process}] {record.name}: {record.getMessage()}"
        if fields:
            line += " " + fields
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str, process_name: str, fmt: str = "text") -> None:
    """One stderr handler for the process: ``fmt`` is its ``log_format`` setting (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json=fmt == "json", process_name=process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# ------------------------------------------------------------------------------------ workers


class WorkerMetrics:
    """Per-request worker metrics (multiprocess-safe when PROMETHEUS_MULTIPROC_DIR is set)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.stage = Histogram("ibex_worker_stage_seconds", "Time per pipeline stage", ["stage"],
                               buckets=BUCKETS, **kw)
        self.branch = Counter("ibex_worker_branch_outcomes_total", "Retrieval branch outcomes",
                              ["branch", "status"], **kw)
        self.packer = Counter("ibex_worker_packer_path_total", "Packer path taken", ["path"], **kw)
        self.outcome = Counter("ibex_worker_requests_total", "Requests by terminal outcome", ["outcome"], **kw)
        self.degraded = Counter("ibex_worker_degraded_total", "Degraded assemblies", **kw)

        # Label children, resolved once: ``labels()`` takes a lock and builds a key on every call,
        # which cost a served assembly more than the updates themselves.
        self._stages: dict[str, Any] = {}
        self._branches: dict[tuple[str, str], Any] = {}
        self._paths: dict[str, Any] = {}
        self._ok = self.outcome.labels("ok")

    def observe(self, timings_us: dict[str, int], branches: dict[str, str], path: str, degraded: bool) -> None:
        stages = self._stages
        for stage, us in timings_us.items():
            child = stages.get(stage)
            if child is None:
                child = stages[stage] = self.stage.labels(stage)
            child.observe(us / 1e6)
        for key in branches.items():
            child = self._branches.get(key)
            if child is None:
                child = self._branches[key] = self.branch.labels(*key)
            child.inc()
        child = self._paths.get(path)
        if child is None:
            child = self._paths[path] = self.packer.labels(path)
        child.inc()
        self._ok.inc()
        if degraded:
            self.degraded.inc()


class CalibrationMetrics:
    """Usage reports by outcome, and each (org, model) sketch's ratio quantiles and sample weight
    as the worker last read them (docs/assembly.md "Calibrated token counts"). Gauges keep the most recent
    value across worker processes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.reports = Counter("ibex_calibration_reports_total",
                               "Usage reports by outcome (accepted, refused_outlier, invalid, ...)", ["outcome"], **kw)
        self.ratio = Gauge("ibex_calibration_ratio", "Provider count / service count, by quantile",
                           ["org", "model", "quantile"], multiprocess_mode="mostrecent", **kw)
        self.samples = Gauge("ibex_calibration_samples", "Effective (decayed) samples in the sketch",
                             ["org", "model"], multiprocess_mode="mostrecent", **kw)
        self.refused = Gauge("ibex_calibration_refused", "Reports refused as outliers, lifetime",
                             ["org", "model"], multiprocess_mode="mostrecent", **kw)

    def observe(self, org: str, model: str, cal: Any) -> None:
        """Publish one key's ``pipeline.counting.calibration.Calibration``."""
        self.ratio.labels(org, model, "0.5").set(cal.median)
        self.ratio.labels(org, model, str(cal.quantile)).set(cal.ratio)
        self.ratio.labels(org, model, "max").set(cal.top)
        self.samples.labels(org, model).set(cal.samples)
        self.refused.labels(org, model).set(cal.refused)


# ------------------------------------------------------------------------------------- broker


class BrokerCollector(Collector):
    """Reads the broker's snapshot at scrape time: no metric calls on the broker's hot path."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        for _ in range(3):  # the broker thread may resize a dict while we copy it
            try:
                snap = self.snapshot()
                break
            except RuntimeError:
                continue
        else:
            return
        yield GaugeMetricFamily("ibex_broker_queue_depth", "Requests waiting in the broker queue",
                                value=snap["queue_depth"])
        yield GaugeMetricFamily("ibex_broker_pending", "Requests accepted and not yet answered",
                                value=snap["pending"])
        yield GaugeMetricFamily("ibex_broker_workers", "Live workers", value=len(snap["workers"]))
        events = CounterMetricFamily("ibex_broker_events", "Broker events: accepted, dispatched, drops by reason",
                                     labels=["event"])
        for name, n in sorted(snap["stats"].items()):
            events.add_metric([name], n)
        yield events


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_wait = Histogram("ibex_broker_queue_wait_seconds", "Time from receipt to dispatch",
                                    buckets=BUCKETS, registry=registry)


def broker_registry(snapshot: Callable[[], dict[str, Any]]) -> tuple[CollectorRegistry, BrokerMetrics]:
    registry = CollectorRegistry()
    registry.register(BrokerCollector(snapshot))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry, BrokerMetrics(registry)


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> None:
    start_http_server(port, addr=addr, registry=registry)


def main(argv: list[str] | None = None) -> int:
    """Serve the aggregated worker metrics of this host (for hosts that run no broker)."""
    ap = argparse.ArgumentParser(prog="python -m ibex_context.shared.config.observability", description=main.__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--addr", default="127.0.0.1")
    args = ap.parse_args(argv)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        print("PROMETHEUS_MULTIPROC_DIR must point at the workers' metrics directory", file=sys.stderr)
        return 2
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    serve(registry, args.port, args.addr)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
