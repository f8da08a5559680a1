"""``python -m bench.pack`` end to end, in a subprocess, on files in a temp directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ibex_context.pipeline.selection.pack import pack
from ibex_context.pipeline.selection.score import score_candidates
from ibex_context.pipeline.types import MemoryHit

ROOT = Path(__file__).resolve().parents[2]

GOOD = {
    "id": "good",
    "token_budget": 1000,
    "candidates": [
        {"memory_id": "a", "tokens": 600, "similarity": 0.95, "confidence": 0.9},
        {"memory_id": "b", "tokens": 450, "similarity": 0.85, "confidence": 0.8},
        {"memory_id": "c", "tokens": 450, "similarity": 0.84, "confidence": 0.8},
        {"memory_id": "d", "tokens": 90, "similarity": 0.75, "confidence": 0.5},
        {"memory_id": "nan", "tokens": 10, "similarity": float("nan"), "confidence": 0.5},
        {"memory_id": "high", "tokens": 10, "similarity": 1.5, "confidence": 0.5},
        {"memory_id": "neg", "tokens": -3, "similarity": 0.9, "confidence": 0.5},
        {"memory_id": "str", "tokens": 5, "similarity": "0.9", "confidence": 0.5},
    ],
}


def _run(
    tmp_path: Path, doc: Any, *extra: str, raw: str | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    cases = tmp_path / "cases.json"
    cases.write_text(raw if raw is not None else json.dumps(doc), encoding="utf-8")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pack", "--cases", str(cases), "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, out


def _expected(case: dict[str, Any]) -> list[str]:
    """The same pipeline in-process: the CLI must report what score + pack decide."""
    hits = [
        MemoryHit(c["memory_id"], "", "bench", c["similarity"], c["confidence"], i, "cold")
        for i, c in enumerate(case["candidates"])
    ]
    tokens = {c["memory_id"]: c["tokens"] for c in case["candidates"]}
    scored, _ = score_candidates(hits, lambda h: tokens[h.memory_id])
    return [m.memory_id for m in pack(scored, case["token_budget"]).packed]


def test_cases_run_and_a_malformed_one_is_reported(tmp_path: Path) -> None:
    doc = {
        "cases": [
            GOOD,
            {"id": "no-budget", "candidates": []},
            {"id": "bad-candidates", "token_budget": 10, "candidates": {"a": 1}},
            {"id": "missing-field", "token_budget": 10, "candidates": [{"memory_id": "x", "tokens": 1}]},
            "not an object",
            {"id": "empty", "token_budget": 500, "candidates": []},
            {"id": "zero-budget", "token_budget": 0, "candidates": GOOD["candidates"][:2]},
        ]
    }
    proc, out = _run(tmp_path, doc, "--repeat", "5")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert [r["id"] for r in results] == [
        "good",
        "no-budget",
        "bad-candidates",
        "missing-field",
        "#4",
        "empty",
        "zero-budget",
    ]

    good = results[0]
    assert good["selected"] == _expected(GOOD) == ["b", "c", "d"]  # DP beats greedy's lone "a"
    assert good["path"] == "dp"
    assert good["total_tokens"] == 990 <= GOOD["token_budget"]
    assert good["evaluated"] == 4 and good["excluded_for_budget"] == 1 and good["budget_reached"] is True
    rejected = {r["memory_id"]: r["reason"] for r in good["rejected"]}
    assert set(rejected) == {"nan", "high", "neg", "str"}
    assert "similarity must be finite" in rejected["nan"]
    assert "similarity must be in [0, 1], got 1.5" in rejected["high"]
    assert "token cost must be a non-negative int" in rejected["neg"]
    assert "similarity must be a number" in rejected["str"]
    assert 0 < good["elapsed_us"]["p50"] <= good["elapsed_us"]["p99"]

    errors = {r["id"]: r["error"] for r in results if "error" in r}
    assert set(errors) == {"no-budget", "bad-candidates", "missing-field", "#4"}
    assert "token_budget" in errors["no-budget"]
    assert "candidates" in errors["bad-candidates"]
    assert "similarity" in errors["missing-field"] and "confidence" in errors["missing-field"]
    for case_id in errors:
        assert repr(case_id) in proc.stderr

    empty = results[5]
    assert (empty["path"], empty["selected"], empty["budget_reached"]) == ("empty", [], False)
    zero = results[6]
    assert (zero["path"], zero["selected"], zero["budget_reached"], zero["excluded_for_budget"]) == (
        "empty",
        [],
        True,
        2,
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "cannot read cases"),
        ('["a list"]', 'expected an object {"cases": [...]}'),
        ('{"cases": 3}', 'expected an object {"cases": [...]}'),
    ],
)
def test_bad_files_exit_2(tmp_path: Path, raw: str, message: str) -> None:
    proc, out = _run(tmp_path, None, raw=raw)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not out.exists()


def test_missing_file_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pack", "--cases", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "nope.json" in proc.stderr


def test_unwritable_output_exits_2(tmp_path: Path) -> None:
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"cases": [GOOD]}), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pack", "--cases", str(cases), "--out", str(tmp_path / "missing-dir" / "o.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot write" in proc.stderr
