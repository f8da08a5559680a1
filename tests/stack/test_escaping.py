"""The escaping rules end to end: the whole rendered text, through the offline pipeline (explain).

Memory bodies escape only ``&``, ``<``, ``>``; attributes also quotes; history and tool schemas get
no entities at all. Still: the block a reader finds by the nonce holds exactly the packed memories,
and no untrusted line reads as one of the formatter's ``## Section`` headings.

Here: the checks through running servers; the pure parts are in
tests/unit/test_escaping.py.
"""

from __future__ import annotations

import subprocess
import sys


def test_bench_escaping_reports_a_saving_in_every_section() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.escaping"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    table = {r[0].strip(): (int(r[1]), int(r[2])) for r in rows[2:]}  # after the header and --- rows
    assert set(table) == {"history", "tools", "memories", "total"}
    assert all(after < before for before, after in table.values())
