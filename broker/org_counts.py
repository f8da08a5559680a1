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


def org_snapshot(queued: Iterable[tuple[str, int]], inflight: Iterable[str], shed: TopCounts,
                 shown: int = ORGS_SHOWN) -> dict[str, object]:
    """``orgs``: queued, in flight and shed for the ``shown`` orgs with most queued and in flight
    (then most shed); ``orgs_other``: the same summed over every other org."""
    rows: dict[str, dict[str, int]] = {}
    for org, n in queued:
        rows[org] = {"queued": n, "inflight": 0, "shed": 0}
    for org in inflight:
        row = rows.get(org) or rows.setdefault(org, {"queued": 0, "inflight": 0, "shed": 0})
        row["inflight"] += 1
    for org, n in shed.counts.items():
        rows.setdefault(org, {"queued": 0, "inflight": 0, "shed": 0})["shed"] = n
    top = heapq.nlargest(shown, rows, key=lambda o: (rows[o]["queued"] + rows[o]["inflight"], rows[o]["shed"]))
    other = {"orgs": len(rows) - len(top), "queued": 0, "inflight": 0, "shed": 0}
    named = set(top)
    for org, row in rows.items():
        if org not in named:
            for k in ("queued", "inflight", "shed"):
                other[k] += row[k]
    return {"orgs": {org: rows[org] for org in top}, "orgs_other": other}
