"""Each org's reserved share of the dispatch rate: a token bucket per org under the shared one,
as Linux's hierarchical token bucket (HTB) nests a class's guaranteed rate under its parent's.

Why: the shared bucket (``broker.admission.DispatchRate``) hands its tokens out in fair order,
but an org that floods keeps it empty, so a request of an org far under its share still waits
for the next token to come (one in ``1 / rate`` seconds) and, with a short deadline and a rate
cut low by the flood, is refused on receipt. Its share is owed to it whatever the others send.

So every org has a reserve that fills at its share of the rate (its weight over the weights of
the orgs that dispatched in the last ``ACTIVE_NS``, it included) and holds ``RESERVE_NS`` of it
(at least ``RESERVE_MIN`` tokens: a request and the next that comes before a refill; more would be
bursts the memory service's short queue refuses, and a refusal cuts the rate for all). A request
goes at once on its org's reserve; with the reserve empty it may still borrow from the shared
bucket (work-conserving: an org alone, or one whose neighbours are idle, uses the whole rate).
Every dispatch also draws on the shared bucket, which reserves take into debt (forgiven past
``-debt_cap``, ``DEBT_NS`` of the rate as it is now, so a cut does not leave the borrowers a debt
of the old rate to repay): the borrowers wait while reserves are used.
The reserves of the active orgs fill at the rate in all (their shares add up to one), and one
that is always drawn (a flooding org's) never holds more than a token, so what the reserves let
through is smooth but for an idle org's own bursts, at most its reserve. An org under its share
therefore never waits for the rate; an org over it gets its share plus what the others leave.

Pure bookkeeping: the caller passes the clock and the rate. An org never seen starts with a full
reserve, as one idle for a while does. Past ``RESERVE_ORGS`` entries the table drops the orgs
idle for ``ACTIVE_NS`` (a caller naming many orgs cannot grow it).
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVE_NS = 50_000_000  # an org's reserve holds this much of its share of the rate
RESERVE_MIN = 2.0  # and at least this many tokens (a request and the next that comes before a refill)
DEBT_NS = 100_000_000  # the shared bucket's debt to reserves is forgiven past this much of the rate
ACTIVE_NS = 1_000_000_000  # orgs that dispatched this recently divide the rate among them
RECOUNT_NS = 10_000_000  # the active orgs' weights are summed at most this often (a scan over orgs)
RESERVE_ORGS = 4096  # entries kept before those of orgs idle for ACTIVE_NS are dropped


@dataclass(slots=True)
class Reserve:
    tokens: float
    refilled_ns: int
    seen_ns: int  # its last dispatch
    weight: float


def debt_cap(rate: float) -> float:
    """How far below zero reserves take the shared bucket at most: ``DEBT_NS`` of the rate."""
    return max(1.0, rate * DEBT_NS / 1e9)


class Reserves:
    """Per-org reserves (module doc)."""

    def __init__(self) -> None:
        self.by_org: dict[str, Reserve] = {}
        self.active_weight = 0.0  # weights of the orgs that dispatched in the last ACTIVE_NS
        self.active: frozenset[str] = frozenset()
        self.counted_ns: int | None = None

    def _count(self, now_ns: int) -> None:
        if self.counted_ns is not None and now_ns - self.counted_ns < RECOUNT_NS:
            return
        active = [(org, r.weight) for org, r in self.by_org.items() if now_ns - r.seen_ns < ACTIVE_NS]
        self.active = frozenset(org for org, _ in active)
        self.active_weight = sum(w for _, w in active)
        self.counted_ns = now_ns

    def share(self, org: str, weight: float, now_ns: int) -> float:
        """``org``'s part of the rate: its weight over the active orgs' weights, it included."""
        self._count(now_ns)
        return weight / (self.active_weight + (0.0 if org in self.active else weight))

    def tokens(self, org: str, weight: float, rate: float, now_ns: int) -> float:
        """What ``org``'s reserve holds now (``rate``: the shared bucket's, requests a second)."""
        share = self.share(org, weight, now_ns)
        cap = max(RESERVE_MIN, rate * share * RESERVE_NS / 1e9)
        r = self.by_org.get(org)
        if r is None:
            return cap  # as an org idle for a while: a new org is no worse off than a known one
        return min(cap, r.tokens + max(0, now_ns - r.refilled_ns) * rate * share / 1e9)

    def fill_ns(self, org: str, weight: float, rate: float, cost: float, now_ns: int) -> float:
        """How long until ``org``'s reserve holds ``cost`` (0 if it does now)."""
        need = cost - self.tokens(org, weight, rate, now_ns)
        if need <= 0:
            return 0.0
        return need * 1e9 / (rate * self.share(org, weight, now_ns))

    def take(self, org: str, weight: float, rate: float, cost: float, now_ns: int) -> bool:
        """Dispatch a request of ``org`` costing ``cost``: from its reserve when that holds it
        (True), else nothing is taken from the reserve (False: the request borrows)."""
        have = self.tokens(org, weight, rate, now_ns)
        used = have >= cost
        r = self.by_org.get(org)
        if r is None:
            if len(self.by_org) >= RESERVE_ORGS:
                self._prune(now_ns)
            r = self.by_org[org] = Reserve(have, now_ns, now_ns, weight)
            self.counted_ns = None
        elif now_ns - r.seen_ns >= ACTIVE_NS or org not in self.active:
            self.counted_ns = None  # it joins the active orgs now: recount at the next share
        r.tokens = have - cost if used else have
        r.refilled_ns = r.seen_ns = now_ns
        r.weight = weight
        return used

    def _prune(self, now_ns: int) -> None:
        """Drop the entries of orgs idle for ``ACTIVE_NS``; if every org is active, start again."""
        self.by_org = {org: r for org, r in self.by_org.items() if now_ns - r.refilled_ns < ACTIVE_NS}
        if len(self.by_org) >= RESERVE_ORGS:
            self.by_org.clear()
        self.counted_ns = None
