"""Per-org counters for the broker's STATUS snapshot, bounded however many orgs callers name.

Without authentication a caller may name any org, so nothing kept per org may grow with the
number of names: ``TopCounts`` keeps at most ``cap`` orgs (when full, the half with the smallest
counts is dropped: the heavy orgs, the ones an operator looks for, stay exact), and the snapshot
shows the ``ORGS_SHOWN`` busiest orgs and sums up the rest.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

ORGS_SHOWN = 16  # orgs named in a STATUS snapshot; the others are summed in "orgs_other"
COUNT_CAP = 1024  # orgs whose shed count is kept


class TopCounts:
    """Counts per org for at most ``cap`` orgs (module doc)."""

    def __init__(self, cap: int = COUNT_CAP) -> None:
        self.cap = cap
        self.counts: dict[str, int] = {}

    def add(self, org: str, n: int = 1) -> None:
        if org not in self.counts and len(self.counts) >= self.cap:
            keep = heapq.nlargest(self.cap // 2, self.counts.items(), key=lambda kv: kv[1])
            self.counts = dict(keep)
        self.counts[org] = self.counts.get(org, 0) + n

    def get(self, org: str) -> int:
        return self.counts.get(org, 0)


FIELDS = ("queued", "inflight", "shed", "held")


def org_snapshot(queued: Iterable[tuple[str, int]], inflight: Iterable[str], shed: TopCounts,
                 held: Iterable[tuple[str, int]] = (), shown: int = ORGS_SHOWN) -> dict[str, object]:
    """``orgs``: queued, in flight, shed and held (slots held for it after fast degraded replies,
    ``broker.admission.Holds``) for the ``shown`` orgs with most queued, in flight and held (then
    most shed); ``orgs_other``: the same summed over every other org."""
    rows: dict[str, dict[str, int]] = {}

    def row(org: str) -> dict[str, int]:
        return rows.get(org) or rows.setdefault(org, dict.fromkeys(FIELDS, 0))

    for org, n in queued:
        row(org)["queued"] = n
    for org in inflight:
        row(org)["inflight"] += 1
    for org, n in held:
        row(org)["held"] = n
    for org, n in shed.counts.items():
        row(org)["shed"] = n
    top = heapq.nlargest(shown, rows, key=lambda o: (rows[o]["queued"] + rows[o]["inflight"] + rows[o]["held"],
                                                     rows[o]["shed"]))
    other = {"orgs": len(rows) - len(top), **dict.fromkeys(FIELDS, 0)}
    named = set(top)
    for org, r in rows.items():
        if org not in named:
            for k in FIELDS:
                other[k] += r[k]
    return {"orgs": {org: rows[org] for org in top}, "orgs_other": other}
