"""Client-side adaptive throttling, per org (Google SRE book, "Handling overload").

When the service refuses most of what an org sends (OVERLOADED), sending more only costs both
sides a round trip per refusal: the client's socket, the broker's loop, on a machine whose CPU is
what is short. So the client keeps, per org, how many requests it was asked to send and how many
the service accepted (answered with anything but OVERLOADED) over the last ``window_s`` seconds
(a request sent counts once its answer is back, one refused here at once), and refuses a new one
locally with probability

    max(0, (requests - k * accepts) / (requests + 1))

at once, typed OVERLOADED (``assemble_or_degrade`` answers it with its degraded fallback, the
reason recorded). With ``k`` = 2 the service still sees about twice what it accepts, so the
client learns at once when it accepts more again; an org the service serves is never refused
(requests <= k * accepts). Nor is an org that sends fewer than ``min_rps`` requests a second over
the window (Envoy's admission control has the same floor, ``rps_threshold``): its refusals cost
the service next to nothing, and at a few requests a second the formula, which counts its own
refusals as requests, takes many windows to let such an org back in after one burst of refusals.
Kept per org, never per client: one org's flood through a shared proxy does not throttle another
org's calls. Deadlines play no part (a longer one buys nothing).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

BUCKETS = 20  # the window in this many slices: a slice's counts leave it whole
MAX_ORGS = 4096  # orgs tracked before those with an empty window are dropped


@dataclass(slots=True)
class _Window:
    starts: list[int] = field(default_factory=lambda: [-1] * BUCKETS)  # slice number of each bucket
    requests: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    accepts: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def add(self, slot: int, requests: int, accepts: int) -> None:
        i = slot % BUCKETS
        if self.starts[i] != slot:
            self.starts[i], self.requests[i], self.accepts[i] = slot, 0, 0
        self.requests[i] += requests
        self.accepts[i] += accepts

    def totals(self, slot: int) -> tuple[int, int]:
        live = [i for i in range(BUCKETS) if slot - BUCKETS < self.starts[i] <= slot]
        return sum(self.requests[i] for i in live), sum(self.accepts[i] for i in live)


class Throttle:
    """Per-org request and accept counts over a sliding window (module doc). ``k`` <= 0: off."""

    def __init__(self, k: float, window_s: float, rand: Callable[[], float] = random.random,
                 min_rps: float = 0.0) -> None:
        if window_s <= 0:
            raise ValueError("the throttle's window must be positive")
        self.k = k
        self.min_requests = min_rps * window_s  # fewer requests than this in the window: never refused
        self.slice_s = window_s / BUCKETS
        self.rand = rand
        self.orgs: dict[str, _Window] = {}

    def _slot(self, now_s: float) -> int:
        return int(now_s / self.slice_s)

    def reject_probability(self, org: str, now_s: float) -> float:
        w = self.orgs.get(org)
        if w is None or self.k <= 0:
            return 0.0
        requests, accepts = w.totals(self._slot(now_s))
        if requests < self.min_requests:
            return 0.0
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def admit(self, org: str, now_s: float) -> bool:
        """Whether to send ``org``'s request. One refused here counts as a request at once; one
        sent counts when its answer comes (``answered``), so a burst sent before any answer is
        back is not refused for answers it has not had yet."""
        p = self.reject_probability(org, now_s)
        if p <= 0.0 or self.rand() >= p:
            return True
        self._window(org, now_s).add(self._slot(now_s), 1, 0)
        return False

    def answered(self, org: str, now_s: float, *, accepted: bool) -> None:
        """The service answered ``org``'s request: ``accepted`` unless it was refused OVERLOADED."""
        self._window(org, now_s).add(self._slot(now_s), 1, int(accepted))

    def _window(self, org: str, now_s: float) -> _Window:
        w = self.orgs.get(org)
        if w is None:
            if len(self.orgs) >= MAX_ORGS:
                self._prune(now_s)
            w = self.orgs[org] = _Window()
        return w

    def _prune(self, now_s: float) -> None:
        slot = self._slot(now_s)
        self.orgs = {o: w for o, w in self.orgs.items() if w.totals(slot)[0]}
