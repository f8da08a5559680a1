"""The one percentile definition of the bench: nearest rank.

The p-th percentile of n samples is the sample at 1-based rank ``max(1, ceil(p / 100 * n))`` of
the sorted samples: a value that was actually observed, never interpolated (p50 of [1, 2, 3, 4]
is 2, p99 of 100 samples is the 99th smallest, of 50 samples the largest; the median is p50, so
of an even number of samples it is the lower middle one). Every suite's tables
use it, for raw samples (``percentile``, ``percentiles``) and for HDR histograms
(``hdr_percentiles``: the same rank over the histogram's counts; the value reported is the top of
the bucket holding that rank, so it is also rounded up to the histogram's 3 significant digits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

DEFAULT = (50.0, 90.0, 99.0)


def rank(n: int, pct: float) -> int:
    """The 1-based nearest rank of the ``pct``-th percentile among ``n`` samples."""
    if n < 1:
        raise ValueError("no samples")
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {pct}")
    return min(n, max(1, math.ceil(pct / 100.0 * n - 1e-9)))  # 1e-9: 99.0 / 100 * 100 is 99.00000000000001


def key(pct: float) -> str:
    """The field name of a percentile in results: ``p50``, ``p99``, ``p99_9``."""
    return f"p{pct:g}".replace(".", "_")


def percentile(samples: Sequence[float] | ArrayLike, pct: float) -> float:
    """The ``pct``-th percentile (nearest rank) of ``samples``; ``ValueError`` when there are none."""
    ordered = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    return float(ordered[rank(len(ordered), pct) - 1])


def median(samples: Sequence[float] | ArrayLike) -> float:
    """p50 by the same definition (of [1, 2, 3, 4]: 2)."""
    return percentile(samples, 50.0)


def percentiles(samples: Sequence[float] | ArrayLike, pcts: Iterable[float] = DEFAULT) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` of ``samples`` (nearest rank), sorted once."""
    ordered = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    return {key(p): float(ordered[rank(len(ordered), p) - 1]) for p in pcts}


def hdr_percentiles(h: Any, pcts: Iterable[float]) -> dict[float, int]:
    """Nearest-rank percentiles of an ``hdrh`` histogram with at least one value, by one walk over its
    counts (hdrh's own ``get_percentile_to_value_dict`` rounds the rank to nearest instead)."""
    n = int(h.get_total_count())
    wanted = sorted((rank(n, p), p) for p in set(pcts))
    out: dict[float, int] = {}
    seen, k = 0, 0
    for index in range(h.counts_len):
        seen += h.get_count_at_index(index)
        while k < len(wanted) and seen >= wanted[k][0]:
            out[wanted[k][1]] = int(h.get_highest_equivalent_value(h.get_value_from_index(index)))
            k += 1
        if k == len(wanted):
            break
    return out
