"""Calibrated token counts (README "Calibrated token counts"): what the provider really charged.

After each call the proxy reports the provider's own prompt count (``usage.prompt_tokens``) for
an assembly; the service keeps, per (org, model), the ratio

    ratio = provider's count / the service's uncalibrated count of the same emitted prompt

(the uncalibrated count is the catalog's rule: exact BPE, or the estimate with the family's
``estimate_factor``). Once a key holds ``min_samples`` (effective) samples, its counts are the
uncalibrated count times a high quantile of the ratio (p99.5 by default) instead of the fixed
factor; exact families never go below their exact count (the multiplier is at least 1).

The sketch is a fixed-bucket histogram of the ratio: ``N_BUCKETS`` log-spaced buckets, each
``BUCKET_GROWTH`` wider than the one before, over [``RATIO_MIN``, ``RATIO_MAX``). A ratio outside
that range is refused and counted (a caller reporting nonsense, or a report matched to the wrong
assembly); quantiles read the bucket's upper edge, so they round up (conservative) by at most one
bucket width (0.5 %). Decay: every new sample multiplies the old weights by ``1 - 1/window``, so
the sketch follows the last ``window`` samples or so and never grows past ``N_BUCKETS`` fields.

Pure functions only: the Redis layout is ``shared.calibration_store``, the worker's copy
``worker.calibration``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

RATIO_MIN = 0.2  # a provider count under a fifth of ours: no tokenizer we know is that much denser
RATIO_MAX = 5.0  # ... or five times ours: the estimate over-counts by design, exact counts are exact
BUCKET_GROWTH = 1.005
N_BUCKETS = math.ceil(math.log(RATIO_MAX / RATIO_MIN) / math.log(BUCKET_GROWTH))
# The safety buffer of a calibrated key: the observed spread above the quantile, at least this
# fraction of the window and never more than the family's fixed fraction.
CALIBRATED_BUFFER_MIN = 0.01


def bucket_of(ratio: float) -> int | None:
    """The bucket index of ``ratio``, or None when it is outside the sane range (refused)."""
    if not math.isfinite(ratio) or not RATIO_MIN <= ratio < RATIO_MAX:
        return None
    return min(N_BUCKETS - 1, int(math.log(ratio / RATIO_MIN) / math.log(BUCKET_GROWTH)))


def upper_edge(index: int) -> float:
    """The largest ratio bucket ``index`` holds (quantiles round up to it)."""
    return RATIO_MIN * BUCKET_GROWTH ** (index + 1)


@dataclass(frozen=True, slots=True)
class Calibration:
    """One (org, model) key's learned ratio, as the budget uses it.

    ``samples`` is the effective (decayed) sample weight, ``quantile`` the level read (0.995),
    ``ratio`` the ratio at that level, ``median`` and ``top`` (the largest bucket seen) describe
    the spread; ``accepted`` and ``refused`` are lifetime report counts.
    """

    samples: float
    quantile: float
    ratio: float
    median: float
    top: float
    accepted: int = 0
    refused: int = 0

    def multiplier(self, *, exact: bool) -> float:
        """What the uncalibrated count is multiplied by: exact families never go below exact."""
        return max(1.0, self.ratio) if exact else self.ratio

    def safety_fraction(self, family_fraction: float) -> float:
        """The buffer sized from the spread above the quantile, within [1 %, the family's fraction]."""
        spread = self.top / self.ratio - 1.0 if self.ratio > 0 else family_fraction
        return min(family_fraction, max(CALIBRATED_BUFFER_MIN, spread))

    def active(self, min_samples: float) -> bool:
        return self.samples >= min_samples


def quantile_of(buckets: Mapping[int, float], q: float) -> float | None:
    """The upper edge of the bucket holding the ``q`` quantile of the weights (None when empty)."""
    total = sum(w for w in buckets.values() if w > 0)
    if total <= 0:
        return None
    need = q * total
    seen = 0.0
    ordered = sorted(i for i, w in buckets.items() if w > 0)
    for i in ordered:
        seen += buckets[i]
        if seen >= need:
            return upper_edge(i)
    return upper_edge(ordered[-1])


def summarize(buckets: Mapping[int, float], *, quantile: float, accepted: int = 0,
              refused: int = 0) -> Calibration | None:
    """The key's ``Calibration`` from its bucket weights; None while it has no sample."""
    live = {i: w for i, w in buckets.items() if w > 0 and 0 <= i < N_BUCKETS}
    ratio = quantile_of(live, quantile)
    if ratio is None:
        return None
    median = quantile_of(live, 0.5) or ratio
    return Calibration(samples=sum(live.values()), quantile=quantile, ratio=ratio, median=median,
                       top=upper_edge(max(live)), accepted=accepted, refused=refused)


def decay_per_sample(window: int) -> float:
    """The weight kept by every older sample when one arrives: the sketch follows ~``window`` samples."""
    return 1.0 - 1.0 / max(1, window)
