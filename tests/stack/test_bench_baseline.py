"""A bench's ``--baseline`` child runs the other checkout's code, not this venv's editable install
(bench/lib/checkout.py), for each layout a checkout of the project has had."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.checkout import checkout_of, memory_server_module, pythonpath

LAYOUTS = {
    # the checkout is the package; folders mapped by package-dir
    "root-package": ('"ibex_context" = "."\n"ibex_context.shared" = "shared"\n', "__init__.py"),
    # an ibex_context/ folder holding the package's __init__; folders mapped by package-dir
    "mapped-folders": ('"ibex_context" = "ibex_context"\n"ibex_context.shared" = "shared"\n',
                       "ibex_context/__init__.py"),
}


def _checkout(root: Path, layout: str) -> Path:
    table, init = LAYOUTS[layout]
    (root / "pyproject.toml").write_text(f"[project]\nname = 'x'\n[tool.setuptools.package-dir]\n{table}")
    (root / init).parent.mkdir(parents=True, exist_ok=True)
    (root / init).write_text("")
    (root / "shared").mkdir()
    (root / "shared" / "__init__.py").write_text("")
    (root / "shared" / "marker.py").write_text(f"WHERE = {str(root)!r}\n")
    (root / "bench").mkdir()
    (root / "bench" / "__init__.py").write_text("")
    (root / "memory" / "service").mkdir(parents=True)
    (root / "memory" / "service" / "server.py").write_text("")
    return root


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_baseline_child_imports_the_baselines_files(tmp_path: Path, layout: str) -> None:
    (tmp_path / "base").mkdir()
    base = _checkout(tmp_path / "base", layout)
    path = pythonpath(base)
    assert checkout_of(path) == base.resolve()
    out = subprocess.run([sys.executable, "-c", "import ibex_context.shared.wire"], cwd=tmp_path,
                         env={"PYTHONPATH": path},
                         capture_output=True, text=True, timeout=60, check=False)
    # the fake checkout has no shared/wire: a name it lacks must fail, not fall through to today's code
    assert out.returncode != 0 and "ibex_context.shared.wire" in out.stderr, out.stdout + out.stderr
    probe = "import ibex_context.shared.marker as m, bench; print(m.WHERE, bench.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": path},
                         capture_output=True, text=True, timeout=60, check=True)
    where, bench_file = out.stdout.split()
    assert where == str(base) and Path(bench_file).resolve() == (base / "bench" / "__init__.py").resolve()
    assert memory_server_module(base) == "ibex_context.memory.service.server"


def test_a_directory_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a checkout"):
        pythonpath(tmp_path)
