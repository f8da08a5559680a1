"""The bench's shared library: one percentile definition, one CPU reader, one suite launcher, and no
suite reaching into another's private names.

Here: the checks through running servers; the pure parts are in
tests/unit/test_bench_lib.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SUITES
from bench.lib.cpu import cpu_seconds, descendants, thread_cpu_seconds
from tests.unit.test_bench_lib import ROOT

# -------------------------------------------------------------------------------------- cpu


_BURN = """
import sys, threading, time
def burn():
    t = time.thread_time() + 0.3
    while time.thread_time() < t:
        pass
th = threading.Thread(target=burn); th.start(); th.join()
print("done", flush=True)
sys.stdin.read()
"""


def test_cpu_of_another_process_keeps_its_ended_threads() -> None:
    """The thread that burnt 0.3 s has ended when we read: its time must still count (a reader of
    the live threads' schedstat would see ~0)."""
    p = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "done"
        assert cpu_seconds(p.pid) >= 0.28
        assert thread_cpu_seconds(p.pid) < 0.25  # the main thread only waited
        assert p.pid in descendants(p.pid) and descendants(p.pid)[0] <= p.pid
    finally:
        p.communicate("")
    with pytest.raises(ProcessLookupError):
        cpu_seconds(p.pid)


def test_python_m_bench_lists_and_runs_suites(tmp_path: Path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)

    listed = bench("--help")
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")] == list(SUITES)
    assert bench("no-such-suite").returncode == 2
    cases, out = tmp_path / "cases.json", tmp_path / "out.json"
    cases.write_text('{"cases": [{"id": "a", "token_budget": 10, "candidates": '
                     '[{"memory_id": "m", "tokens": 4, "similarity": 0.9, "confidence": 0.9}]}]}')
    ran = bench("pack", "--cases", str(cases), "--out", str(out))
    assert ran.returncode == 0, ran.stderr
    assert '"selected": [\n        "m"\n      ]' in out.read_text()
    assert bench("pack", "--cases", str(tmp_path / "missing.json"), "--out", str(out)).returncode == 2
