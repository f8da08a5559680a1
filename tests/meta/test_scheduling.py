"""``make pytest``'s xdist options with ``tests.scheduling``: a file's tests run on one worker, its
module fixtures are built once, and files of a shared group run on the same worker. Run as a
pytest of its own on two workers over probe files named as the suite's files are."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scheduling import GROUP_OF

ROOT = Path(__file__).resolve().parents[2]

# The options of `make pytest` that decide where a test runs.
MAKEFILE_OPTIONS = re.search(r"pytest -n 2 (--dist \S+ --no-loadscope-reorder)", (ROOT / "Makefile").read_text())

PROBE = '''
import json, os, pytest

@pytest.fixture(scope="module")
def built(request):
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(json.dumps({"setup": request.module.__name__}) + "\\n")
    return request.module.__name__

@pytest.mark.parametrize("i", range(4))
def test_probe(built, i):
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(json.dumps({"ran": built, "worker": os.environ["PYTEST_XDIST_WORKER"]}) + "\\n")
'''


@pytest.mark.timeout(120)
def test_files_and_shared_groups_stay_on_one_worker(tmp_path: Path) -> None:
    assert MAKEFILE_OPTIONS is not None, "make pytest's xdist options not found in the Makefile"
    shared = [p for p, g in GROUP_OF.items() if g == "minilm"]
    assert len(shared) == 2
    own = ["tests/stack/test_probe_a.py", "tests/stack/test_probe_b.py", "tests/unit/test_probe_c.py"]
    for rel in shared + own:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(PROBE)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.scheduling"]\n')
    log = tmp_path / "probe.jsonl"
    env = {**os.environ, "PROBE_LOG": str(log), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           *MAKEFILE_OPTIONS.group(1).split(), "--rootdir", str(tmp_path), "-c", os.devnull,
                           *(shared + own)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    setups = [e["setup"] for e in events if "setup" in e]
    workers: dict[str, set[str]] = {}
    for e in events:
        if "ran" in e:
            workers.setdefault(e["ran"], set()).add(e["worker"])
    assert len(workers) == 5 and sorted(setups) == sorted(workers), setups  # each module's fixture built once
    assert all(len(w) == 1 for w in workers.values()), workers
    minilm = {Path(p).stem for p in shared}
    assert len({next(iter(workers[m])) for m in minilm}) == 1, workers  # the shared group on one worker
