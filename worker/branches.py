"""Retrieval's record of each branch and what the pipeline gets from them (``worker.retrieve``):
each branch's outcome, the directive, the hits and refusals of the branches that succeeded, and
the stored summary read in the directive's round trip."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..pipeline.types import Rejection, RetrievalResult
from ..shared.stores.summaries import decode_summary
from ..shared.wire.models import BranchName, BranchOutcome, SummarySlot


@dataclass
class Branch:
    name: BranchName
    status: Literal["success", "timeout", "error", "skipped"] = "skipped"
    elapsed_ms: float = 0.0
    error_class: str | None = None
    detail: str | None = None
    value: Any = None
    rejects: list[Rejection] = field(default_factory=list)
    attempts: int = 1
    given_back_ns: int = 0  # the loop's busy time its limit was extended by

    def outcome(self, count: int) -> BranchOutcome:
        return BranchOutcome(status=self.status, elapsed_ms=round(self.elapsed_ms, 3),
                             error_class=self.error_class, detail=self.detail, count=count)


@dataclass
class Stored:
    """The stored summary's part of the directive branch: its raw value once read."""

    wanted: bool
    fetched: bool = False
    raw: bytes | None = None
    problem: str | None = None  # Redis refused the read (e.g. WRONGTYPE)


def summary_outcome(d: Branch, stored: Stored) -> tuple[SummarySlot | None, BranchOutcome]:
    """The stored summary and its outcome: the round trip's when it never completed; else found,
    absent (success, count 0: no summary made yet) or unusable (error ``MalformedSummary``)."""
    elapsed = round(d.elapsed_ms, 3)
    if not stored.fetched:
        status = d.status if d.status in ("timeout", "error") else "error"
        return None, BranchOutcome(status=status, elapsed_ms=elapsed, error_class=d.error_class, detail=d.detail)
    decoded = stored.problem or (None if stored.raw is None else decode_summary(stored.raw))
    if isinstance(decoded, str):
        return None, BranchOutcome(status="error", elapsed_ms=elapsed, error_class="MalformedSummary",
                                   detail=f"stored summary ignored: {decoded}"[:200])
    detail = None if decoded is not None else "no summary stored under this summary_key"
    return decoded, BranchOutcome(status="success", elapsed_ms=elapsed, count=int(decoded is not None), detail=detail)


def retrieval_result(branches: dict[BranchName, Branch], stored: Stored, *, include_directive: bool) -> RetrievalResult:
    """What the pipeline gets: each successful branch's hits and refusals, every branch's outcome,
    and the stored summary when the request asked for it."""
    d = branches["directive"]
    directive = d.value if d.status == "success" else None
    hot, hot_rej = branches["hot"].value if branches["hot"].status == "success" else ([], [])
    cold, cold_rej = branches["cold"].value if branches["cold"].status == "success" else ([], [])
    counts = {"directive": int(directive is not None), "hot": len(hot), "cold": len(cold)}
    outcomes: dict[BranchName, BranchOutcome] = {name: br.outcome(counts[name]) for name, br in branches.items()}
    if not include_directive:  # the branch ran for the summary alone
        outcomes["directive"] = Branch("directive", detail="disabled by request options or settings").outcome(0)
    summary = None
    if stored.wanted:
        summary, outcomes["summary"] = summary_outcome(d, stored)
    return RetrievalResult(directive=directive, hot=tuple(hot), cold=tuple(cold),
                           rejections=tuple([*hot_rej, *cold_rej]), outcomes=outcomes, summary=summary)
