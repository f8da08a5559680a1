"""The compaction summary slot through the one pipeline (offline): placement per target, framing
as untrusted data, the exact count, the window, ``covers`` checks, the history report and
``history_dropped_upto``, and a prefix that stays the same while the summary does.

Here: the checks through running servers; the pure parts are in
tests/unit/test_summary_slot.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# --------------------------------------------------------------------------- ibex-context explain

def test_explain_takes_the_summary_from_the_request_file(tmp_path: Path) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    args = [sys.executable, "-m", "ibex_context.ops.cli", "explain", "--candidates", str(examples / "candidates.json")]
    out = subprocess.run([*args, "--request", str(examples / "chat_request_summary.json"), "--format", "json"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["summary"]["placed"] and doc["summary"]["covers"] == 4 and doc["history_dropped_upto"] == 4
    assert [s["name"] for s in doc["sections"]] == ["directive", "summary", "memories"]
    table = subprocess.run([*args, "--request", str(examples / "chat_request_summary.json")],
                           capture_output=True, text=True, timeout=60, check=False)
    assert "Summary (request): covers 4 messages" in table.stdout and "summarized: replaced" in table.stdout
    bad = {**json.loads((examples / "chat_request_summary.json").read_text()), "summary": {"text": "s", "covers": 9}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    out = subprocess.run([*args, "--request", str(tmp_path / "bad.json")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and "summary.covers: 9 is more than the 7 non-system messages" in out.stderr
