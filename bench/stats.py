"""HDR histograms per latency component, and their summaries.

Percentiles are nearest-rank over the histogram's counts (``bench.lib.percentiles``, the bench's
one definition). Every value is recorded in integer microseconds. ``HdrHistogram`` keeps 3 significant digits from
1 µs up to ``HIGHEST_US``; a value outside that range is clamped (and counted) rather than dropped,
so a histogram's count always equals the number of requests it describes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from hdrh.histogram import HdrHistogram

from bench.lib.percentiles import hdr_percentiles

HIGHEST_US = 60_000_000  # one minute: far beyond any deadline, so clamping means a broken run
SIGFIG = 3
PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9))

# Components of one request's client-observed latency, in the order they are stacked in plots.
# ``send_lag`` (generator late against its own schedule) is split out so that an overloaded load
# generator is visible instead of hiding inside ``transport``.
WORKER_STAGES = ("retrieval", "budget", "scoring", "packing", "formatting")
COMPONENTS = ("send_lag", "queue_wait", "worker_wait", *WORKER_STAGES, "transport")


def new_histogram() -> HdrHistogram:
    return HdrHistogram(1, HIGHEST_US, SIGFIG)


class Histograms:
    """Named HDR histograms created on first use, with clamp counters."""

    def __init__(self) -> None:
        self.hists: dict[str, HdrHistogram] = {}
        self.clamped: dict[str, int] = {}
        self.sums: dict[str, int] = {}  # exact means (hdrh's get_mean_value walks every bucket: slow)

    def record(self, name: str, value_us: float) -> None:
        h = self.hists.get(name)
        if h is None:
            h = self.hists[name] = new_histogram()
        v = math.floor(value_us + 0.5)
        if v < 0 or v > HIGHEST_US:
            self.clamped[name] = self.clamped.get(name, 0) + 1
            v = min(max(v, 0), HIGHEST_US)
        h.record_value(v)
        self.sums[name] = self.sums.get(name, 0) + v

    def record_many(self, name: str, values_us: Iterable[float]) -> None:
        for v in values_us:
            self.record(name, v)

    def count(self, name: str) -> int:
        h = self.hists.get(name)
        return 0 if h is None else int(h.get_total_count())

    def summary(self, order: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        names = [n for n in order if n in self.hists] + sorted(set(self.hists) - set(order))
        return {n: summarize(self.hists[n], clamped=self.clamped.get(n, 0), total=self.sums.get(n)) for n in names}


def summarize(h: HdrHistogram, *, clamped: int = 0, total: int | None = None) -> dict[str, Any]:
    """count, mean and p50/p90/p99/p99.9/max in µs (HDR-rounded to 3 significant digits).

    ``total`` is the exact sum of the recorded values, for the mean; without it hdrh's own mean
    is used (it walks every bucket: ~80 ms per histogram).
    """
    n = int(h.get_total_count())
    out: dict[str, Any] = {"count": n}
    if n == 0:
        out.update({k: None for k, _ in PERCENTILES} | {"max": None, "mean": None})
        return out
    values = hdr_percentiles(h, [pct for _, pct in PERCENTILES])
    for key, pct in PERCENTILES:
        out[key] = int(values[pct])
    out["max"] = int(h.get_max_value())
    out["mean"] = round(total / n if total is not None else float(h.get_mean_value()), 1)
    if clamped:
        out["clamped"] = clamped
    return out


def ms(summary: Mapping[str, Any] | None, key: str) -> float | None:
    """A summary field converted from µs to ms (None stays None)."""
    if not summary or summary.get(key) is None:
        return None
    return round(summary[key] / 1000.0, 3)
