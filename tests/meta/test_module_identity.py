"""One file, one module: every product file loads under its ``ibex_context.`` name only.

pyproject.toml maps each top-level folder to its ``ibex_context`` name (no symlinked tree). From
the repo root the folders are also on ``sys.path`` (pytest, ``python -m bench``), so a file is
reachable as ``shared.wire.errors`` there; loaded both ways it would be two modules with two
``IbexError`` classes, and an ``except IbexError`` could miss. Each folder's ``__init__`` refuses
its bare name; this checks it in a fresh interpreter started in the repo root, and that outside
the checkout the installed package is the only way to reach the files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.meta.layout import FOLDERS, PACKAGE, PACKAGE_DIRS, PACKAGES, ROOT

# Bare names, then every module through ibex_context, then the bare names again (a bare import
# after the real one must fail too); then every module object whose file lies in the checkout.
_PROBE = r"""
import importlib, json, os, sys
bare, real, root = json.loads(sys.argv[1])

def try_bare():
    out = {}
    for name in bare:
        try:
            importlib.import_module(name)
            out[name] = "loaded"
        except ImportError as exc:
            out[name] = str(exc)
    return out

before = try_bare()
for name in real:
    importlib.import_module(name)
after = try_bare()
by_file = {}
for name, mod in list(sys.modules.items()):
    path = getattr(mod, "__file__", None)
    if path and os.path.realpath(path).startswith(root + os.sep):
        by_file.setdefault(os.path.realpath(path), {})[id(mod)] = name
print(json.dumps({"before": before, "after": after,
                  "files": {path: sorted(mods.values()) for path, mods in by_file.items()}}))
"""


def _modules() -> list[str]:
    """Every importable module of the folders by its bare name (``data/`` holds scripts run by path)."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts[:-1] if p.name == "__init__.py"
                           else p.relative_to(ROOT).with_suffix("").parts)
                  for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
                  if "data" not in p.relative_to(ROOT).parts)


def test_no_file_loads_as_two_modules() -> None:
    bare = _modules()
    assert len(bare) > 100 and "shared.wire.errors" in bare  # the probe looks at the real tree
    real = ["ibex_context", *(f"ibex_context.{name}" for name in bare)]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([bare, real, str(ROOT)])], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for when in ("before", "after"):
        wrong = {name: why for name, why in got[when].items()
                 if why != f"import ibex_context.{name.split('.')[0]}, not {name.split('.')[0]}"}
        assert not wrong, f"bare imports not refused ({when} the real ones): {wrong}"
    twice = {path: names for path, names in got["files"].items() if len(names) > 1}
    assert not twice, f"files loaded as two modules: {twice}"
    loaded = {name for names in got["files"].values() for name in names}
    assert set(real) <= loaded, sorted(set(real) - loaded)


def test_every_package_is_listed_and_mapped() -> None:
    """The wheel and the editable install hold exactly the folders with an ``__init__.py``."""
    assert PACKAGE_DIRS[PACKAGE] == ROOT and set(FOLDERS) >= {"broker", "client", "shared", "worker"}
    on_disk = {PACKAGE, *(f"{PACKAGE}.{'.'.join(p.parent.relative_to(ROOT).parts)}"
                          for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py"))}
    assert sorted(PACKAGES) == sorted(on_disk)
    # the checkout is the package (its __init__ at the root): no ibex_context/ tree beside it, no folder links
    assert (ROOT / "__init__.py").is_file()
    assert not [p for p in (ROOT / PACKAGE).rglob("*") if "__pycache__" not in p.parts and p.name != "__pycache__"]
    assert not [p for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.is_symlink() and p.is_dir()]


_OUTSIDE = r"""
import importlib, importlib.util, json, os, sys
names, root = json.loads(sys.argv[1])
files = {}
for name in names:
    files[name] = os.path.realpath(importlib.import_module(name).__file__)
bare = [m for m in ("broker", "client", "memory", "ops", "pipeline", "shared", "worker") if importlib.util.find_spec(m)]
print(json.dumps({"files": files, "bare": bare}))
"""


def test_outside_the_checkout_only_the_package_name_reaches_the_files(tmp_path: Path) -> None:
    """The installed package (editable here) maps each name to the checkout's folder; no bare name exists."""
    names = [PACKAGE, *(f"{PACKAGE}.{folder}" for folder in FOLDERS), f"{PACKAGE}.shared.wire.errors"]
    out = subprocess.run([sys.executable, "-c", _OUTSIDE, json.dumps([names, str(ROOT)])], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bare"] == []
    assert got["files"][f"{PACKAGE}.shared.wire.errors"] == str(ROOT / "shared" / "wire" / "errors.py")
    for folder in FOLDERS:
        assert got["files"][f"{PACKAGE}.{folder}"] == str(ROOT / folder / "__init__.py")
