"""bench.calibration runs end to end on a real (embedded) Redis and its figures are well-formed
(docs/assembly.md "Calibrated token counts"); the over-charge targets are the full run's to report."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench import calibration as bc


def test_conversations_are_valid_and_end_with_the_user() -> None:
    rng, pool = random.Random(1), bc.text_pool()
    conv = bc.conversation(rng, pool, 5000)
    assert conv[-1]["role"] == "user" and sum(len(m.get("content") or "") for m in conv) >= 5000
    # every 7th turn is a tool call: short texts make sure there are 7 (a docs table is one long text)
    assert any(m.get("tool_calls") for m in bc.conversation(rng, [t[:200] for t in pool], 20_000))
    assert len(bc.demo_hits()) == 20


def test_a_small_run_calibrates_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bc.main(["--n", "60", "--min-samples", "20", "--batch", "10", "--out", str(out)]) == 0
    res = json.loads((out / "calibration.json").read_text())
    before, after = res["before"], res["after_calibrated_only"]
    assert before["n"] == 60 and after is not None and 0 < after["n"] <= 40
    assert res["final_sketch"]["accepted"] == 60 and res["final_sketch"]["refused"] == 0
    assert after["median"] < before["median"]  # the estimate over-charges; calibration learns by how much
    assert "| before (catalog rule) | 60 |" in (out / "calibration.md").read_text()
