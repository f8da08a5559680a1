"""Run the packer over cases from a JSON file: ``python -m bench.pack --cases C.json --out R.json``.

Input::

    {"cases": [{"id": ..., "token_budget": int,
                "candidates": [{"memory_id": str, "tokens": int, "similarity": float,
                                "confidence": float}, ...]}, ...]}

Each case's candidates go through ``worker.score.score_candidates`` (cost = the given ``tokens``)
and then ``worker.pack.pack``; a candidate the scorer refuses is listed under ``rejected`` with
its reason. ``elapsed_us`` times the ``pack`` call alone over ``--repeat`` runs (p50, p99).
A case that is not shaped as above gets ``{"id": ..., "error": ...}`` and the other cases
still run. A file that cannot be read, parsed or written exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.percentiles import percentile
from ibex_context.pipeline.selection.pack import pack
from ibex_context.pipeline.selection.score import score_candidates
from ibex_context.pipeline.types import MemoryHit

_CANDIDATE_KEYS = ("memory_id", "tokens", "similarity", "confidence")


class CaseError(ValueError):
    """A case that is not shaped as the input format says."""


def _hits(case: dict[str, Any]) -> tuple[list[MemoryHit], dict[int, Any]]:
    """MemoryHits for a case's candidates, and each hit's given token cost (keyed by id(hit))."""
    candidates = case.get("candidates")
    if not isinstance(candidates, list):
        raise CaseError("'candidates' must be a list")
    hits: list[MemoryHit] = []
    costs: dict[int, Any] = {}
    for index, cand in enumerate(candidates):
        if not isinstance(cand, dict):
            raise CaseError(f"candidate {index} must be an object")
        missing = [key for key in _CANDIDATE_KEYS if key not in cand]
        if missing:
            raise CaseError(f"candidate {index} is missing {', '.join(missing)}")
        if not isinstance(cand["memory_id"], str):
            raise CaseError(f"candidate {index}: memory_id must be a string")
        # Scores and tokens are passed through as given: the scorer judges them (with reasons).
        hit = MemoryHit(
            memory_id=cand["memory_id"],
            content="",
            category="bench",
            similarity=cand["similarity"],
            confidence=cand["confidence"],
            rank=index,
            source="cold",
        )
        hits.append(hit)
        costs[id(hit)] = cand["tokens"]
    return hits, costs


def run_case(case: object, repeat: int) -> dict[str, Any]:
    """One result entry; raises CaseError when the case is malformed."""
    if not isinstance(case, dict):
        raise CaseError("case must be an object")
    if "id" not in case:
        raise CaseError("case has no 'id'")
    budget = case.get("token_budget")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise CaseError("'token_budget' must be an integer")
    hits, costs = _hits(case)
    scored, rejected = score_candidates(hits, lambda hit: costs[id(hit)])

    elapsed_ns: list[int] = []
    result = None
    for _ in range(repeat):
        start = time.perf_counter_ns()
        try:
            result = pack(scored, budget)
        except (ValueError, OverflowError) as exc:  # e.g. a token count beyond int64
            raise CaseError(f"packer refused the case: {exc}") from exc
        elapsed_ns.append(time.perf_counter_ns() - start)
    if result is None:
        raise CaseError("repeat must be >= 1")
    return {
        "id": case["id"],
        "selected": [m.memory_id for m in result.packed],
        "total_tokens": result.total_tokens,
        "total_score": result.total_score,
        "path": result.path,
        "evaluated": result.evaluated,
        "excluded_for_budget": result.excluded_for_budget,
        "budget_reached": result.budget_reached,
        "rejected": [{"memory_id": r.memory_id, "reason": r.reason} for r in rejected],
        "elapsed_us": {"p50": percentile(elapsed_ns, 50) / 1e3, "p99": percentile(elapsed_ns, 99) / 1e3},
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pack", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=Path, required=True, help="input JSON file")
    parser.add_argument("--out", type=Path, required=True, help="where to write the results JSON")
    parser.add_argument("--repeat", type=_positive_int, default=1, help="timed pack() calls per case")
    args = parser.parse_args(argv)

    try:
        doc = json.loads(args.cases.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        print(f"bench.pack: cannot read cases from {args.cases}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        print(f'bench.pack: {args.cases}: expected an object {{"cases": [...]}}', file=sys.stderr)
        return 2

    results: list[dict[str, Any]] = []
    for index, case in enumerate(doc["cases"]):
        case_id = case.get("id", f"#{index}") if isinstance(case, dict) else f"#{index}"
        try:
            results.append(run_case(case, args.repeat))
        except CaseError as exc:
            print(f"bench.pack: case {case_id!r} skipped: {exc}", file=sys.stderr)
            results.append({"id": case_id, "error": str(exc)})

    try:
        args.out.write_text(json.dumps({"results": results}, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"bench.pack: cannot write {args.out}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
