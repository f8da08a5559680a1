"""Admission for usage reports: token buckets per caller key, per org and over the whole broker.
Compaction summaries to store (protocol SUMMARY) are admitted by the same rules, with buckets of
their own (``IBEX_SUMMARY_RATE_*``): a flood of one kind never sheds the other.

A usage report costs a worker a validation and a Redis lookup, and takes no credit, so without a
limit one caller's reports can take the workers' CPU and Redis from every org's assemblies. The
broker holds them to three token buckets, checked in this order:

* per caller key (the CURVE key when authentication is on, else the connection's routing id),
  before the report is even decoded, so a flood costs the broker a few microseconds a report;
* per org (the org the broker authorized), after the envelope is checked;
* in total, a backstop for callers that are many keys or, without authentication, name many orgs.

A report over a limit is shed: dropped and counted (``usage_shed_key``, ``usage_shed_org``,
``usage_shed_total``). The first shed report of a key in each ``NOTICE_NS`` is answered
OVERLOADED, so the caller learns it is over its limit (the client counts it in
``usage_refused``), without one reply per shed report. Reports are samples for a calibration
sketch (docs/assembly.md "Calibrated token counts"): shedding above the limit samples them, it loses no
assembly's answer.

A bucket holds ``rate * burst_s`` tokens (at least one) and refills at ``rate`` a second; a rate
of 0 turns that limit off. Pure bookkeeping on ``now_ns`` (local monotonic) passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

NOTICE_NS = 1_000_000_000  # a key over its limit hears OVERLOADED at most once a second
MAX_BUCKETS = 100_000  # keys and orgs remembered at once; beyond it the least recently seen is forgotten
FORGET_PER_TAKE = 2  # refilled buckets forgotten per report at most: no sweep ever stalls the broker
SHED_WHY = {"busy": "requests are waiting for a worker (assemblies go first)",
            "key": "this caller key is over IBEX_USAGE_RATE_PER_KEY",
            "org": "this org is over IBEX_USAGE_RATE_PER_ORG",
            "total": "the broker is over IBEX_USAGE_RATE_TOTAL"}


def shed_message(why: str, kind: str = "usage") -> str:
    """The OVERLOADED notice's text for a report (``kind`` "usage" or "summary") shed by limit
    ``why`` (a ``SHED_WHY`` key; a summary's limits are the IBEX_SUMMARY_RATE_* settings)."""
    limit = SHED_WHY[why] if kind == "usage" else SHED_WHY[why].replace("IBEX_USAGE_", "IBEX_SUMMARY_")
    what = "usage report" if kind == "usage" else "summary"
    return (f"{what} shed: {limit}; {what}s this caller sends in the next second that are "
            "shed are dropped without a reply")


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    rate_per_ns: float
    tokens: float
    stamp_ns: int

    def level(self, now_ns: int) -> float:
        """Tokens now (refilled since the last take, never above the capacity)."""
        return min(self.capacity, self.tokens + (now_ns - self.stamp_ns) * self.rate_per_ns)

    def take(self, now_ns: int) -> bool:
        """One token if there is one."""
        tokens = self.level(now_ns)
        self.stamp_ns = now_ns
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True


class Buckets:
    """One token bucket per name, made full on first sight and forgotten once full again. The
    table is kept least recently seen first, so each take looks only at its front for buckets that
    have refilled (a fresh one would be the same): memory follows the active names, at O(1) a take."""

    def __init__(self, rate_per_s: float, burst_s: float) -> None:
        self.on = rate_per_s > 0
        self.capacity = max(1.0, rate_per_s * burst_s)
        self.rate_per_ns = rate_per_s / 1e9
        self.table: dict[object, TokenBucket] = {}

    def take(self, name: object, now_ns: int) -> bool:
        if not self.on:
            return True
        table = self.table
        b = table.pop(name, None)
        for _ in range(FORGET_PER_TAKE):
            oldest = next(iter(table.items()), None)
            if oldest is None or oldest[1].level(now_ns) < self.capacity:
                break
            del table[oldest[0]]
        if b is None:
            if len(table) >= MAX_BUCKETS:
                del table[next(iter(table))]
            b = TokenBucket(self.capacity, self.rate_per_ns, self.capacity, now_ns)
        table[name] = b  # now the most recently seen
        return b.take(now_ns)


class UsageLimits:
    """The three limits and the once-a-second notice, for ``Broker._on_usage``."""

    def __init__(self, *, per_key: float, per_org: float, total: float, burst_s: float) -> None:
        self.keys = Buckets(per_key, burst_s)
        self.orgs = Buckets(per_org, burst_s)
        self.total = Buckets(total, burst_s)
        self.noticed: dict[bytes, int] = {}  # key -> when it was last answered OVERLOADED, oldest first

    def admit_key(self, key: bytes, now_ns: int) -> bool:
        return self.keys.take(key, now_ns)

    def admit_org(self, org_id: str, now_ns: int) -> str | None:
        """None when the report may go on, else the limit that sheds it ("org" or "total")."""
        if not self.orgs.take(org_id, now_ns):
            return "org"
        return None if self.total.take(None, now_ns) else "total"

    def notice(self, key: bytes, now_ns: int) -> bool:
        """Whether this shed report is answered: the key's first shed in ``NOTICE_NS``."""
        noticed = self.noticed
        last = noticed.get(key)
        if last is not None and now_ns - last < NOTICE_NS:
            return False
        noticed.pop(key, None)
        for _ in range(FORGET_PER_TAKE):  # the oldest notices are over NOTICE_NS: forgotten
            oldest = next(iter(noticed.items()), None)
            if oldest is None or now_ns - oldest[1] < NOTICE_NS:
                break
            del noticed[oldest[0]]
        if len(noticed) >= MAX_BUCKETS:
            del noticed[next(iter(noticed))]
        noticed[key] = now_ns
        return True
