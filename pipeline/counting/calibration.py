"""Calibrated token counts (docs/assembly.md "Calibrated token counts"): what the provider really charged.

After each call the proxy reports the provider's own prompt count (``usage.prompt_tokens``) for
an assembly; the service keeps, per (org, model), the ratio

    ratio = provider's count / the service's uncalibrated count of the same emitted prompt

(the uncalibrated count is the catalog's rule: exact BPE, or the estimate with the family's
``estimate_factor``). The denominator is the service's own: the worker that assembled records it
under an id it issues in the reply, and a report is matched to that record (the count a report
claims is never used; ``worker.calibration``). Once a key holds ``min_samples`` (effective)
samples, its counts are the uncalibrated count times the key's multiplier instead of the fixed
factor (``Calibration.multiplier``).

The sketch is a fixed-bucket histogram of the ratio: ``N_BUCKETS`` log-spaced buckets, each
``BUCKET_GROWTH`` wider than the one before, over [``RATIO_MIN``, ``RATIO_MAX``). A ratio outside
that range is refused and counted (a caller reporting nonsense, or a report matched to the wrong
assembly); quantiles read the bucket's upper edge, so they round up (conservative) by at most one
bucket width (0.5 %). Decay: every new sample multiplies the old weights by ``1 - 1/window``, so
the sketch follows the last ``window`` samples or so and never grows past ``N_BUCKETS`` fields.

What a caller can do with reports is bounded twice, because every field of a report is the
caller's word:

* **Bounded change.** The multiplier is not the quantile itself but a *served* bucket that follows
  it: up at once (a rise is the safe direction: the provider counts more than we thought), down by
  at most ``MAX_FALL_BUCKETS`` buckets (2 %) per flush, at most one such step per
  ``FALL_INTERVAL_MS`` whichever worker flushes, and only once the key has ``min_samples``. It
  starts at ``UNCALIBRATED_BUCKET`` (the catalog's rule, x1.0) and moves only when reports are
  written. So one flush, however many reports it carries, lowers a key's counts by at most 2 %,
  and a sustained campaign by at most 2 % per 250 ms.
* **A floor** (``multiplier_floor``) that keeps every emitted prompt within window - reserve by
  the exact encoders whatever the sketch holds: see ``Calibration.multiplier``.

Pure functions only: the Redis layout is ``worker.calibration_store``, the worker's copy
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
# Bounded change (module docstring): the served bucket falls by at most this many buckets per
# flush (1.005 ** 4: 2.0 %), at most once per FALL_INTERVAL_MS per key, from the bucket of 1.0.
MAX_FALL_BUCKETS = 4
FALL_INTERVAL_MS = 250
# 1/factor computed in floating point may land a hair under the true quotient; the floor is
# nudged up by this much so that ceil(ceil(n * factor) * floor) >= n holds for every count n.
FLOOR_SLACK = 1e-9


def bucket_of(ratio: float) -> int | None:
    """The bucket index of ``ratio``, or None when it is outside the sane range (refused)."""
    if not math.isfinite(ratio) or not RATIO_MIN <= ratio < RATIO_MAX:
        return None
    return min(N_BUCKETS - 1, int(math.log(ratio / RATIO_MIN) / math.log(BUCKET_GROWTH)))


def upper_edge(index: int) -> float:
    """The largest ratio bucket ``index`` holds (quantiles round up to it)."""
    return RATIO_MIN * BUCKET_GROWTH ** (index + 1)


# Where a key's served bucket starts: the one holding 1.0 (the catalog's rule; upper edge x1.0016).
UNCALIBRATED_BUCKET = int(math.log(1.0 / RATIO_MIN) / math.log(BUCKET_GROWTH))


def multiplier_floor(*, exact: bool, estimate_factor: float) -> float:
    """The lowest multiplier a key may charge, whatever its reports said.

    Exact families (the provider's own tokenizer, o200k/cl100k; llama3/qwen): 1.0, so a count is
    never below the exact count of the emitted prompt plus the framing the service already charges;
    calibration there only adds what the provider frames on top (per-message overhead it keeps to
    itself).

    Estimate families: ``1 / estimate_factor`` (1.0 when the factor is below 1). Their uncalibrated
    count of a piece of text is ``ceil(raw * factor)``, ``raw`` being the conservative estimate,
    which is built never to undercount any exact encoder the service ships (``pipeline.counting.tokens``). So a
    calibrated piece, ``ceil(ceil(raw * factor) * multiplier)``, is never below ``raw``; the framing
    constants are not scaled at all. Every prompt count, and so the history fit and the final
    check against window - reserve, stays an upper bound of the prompt counted by any shipped exact
    encoder, even with a sketch full of lies. Calibration keeps its use there: as far as the
    provider's counts show, it takes back the family's ``estimate_factor`` (20 % of the count at
    x1.25) and narrows the safety buffer to the observed spread, but never the estimate's own
    margin over the exact encoders, which no report can prove unneeded.
    """
    if exact:
        return 1.0
    return min(1.0, (1.0 / max(1.0, estimate_factor)) * (1.0 + FLOOR_SLACK))


@dataclass(frozen=True, slots=True)
class Calibration:
    """One (org, model) key's learned ratio, as the budget uses it.

    ``samples`` is the effective (decayed) sample weight, ``quantile`` the level read (0.995),
    ``ratio`` the ratio at that level, ``median`` and ``top`` (the largest bucket seen) describe
    the spread; ``accepted`` and ``refused`` are lifetime report counts. ``served`` is the ratio
    the key charges: the quantile followed in bounded steps (module docstring); None in a
    calibration built from weights alone, which then charges ``ratio``.
    """

    samples: float
    quantile: float
    ratio: float
    median: float
    top: float
    accepted: int = 0
    refused: int = 0
    served: float | None = None

    def multiplier(self, *, exact: bool, estimate_factor: float = 1.0) -> float:
        """What the uncalibrated count is multiplied by: the served ratio, never below
        ``multiplier_floor`` (exact families: 1.0; estimate families: 1 / ``estimate_factor``, and
        1.0 when the factor is not given)."""
        basis = self.ratio if self.served is None else self.served
        return max(multiplier_floor(exact=exact, estimate_factor=estimate_factor), basis)

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
