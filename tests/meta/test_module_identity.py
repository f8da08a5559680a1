"""One file, one module: every product file loads under its ``ibex_context.`` name only.

``ibex_context/`` reaches the top-level folders through symlinks, so from the repo root a file is
reachable as ``shared.wire.errors`` and as ``ibex_context.shared.wire.errors``. Loaded both ways it would be
two modules with two ``IbexError`` classes, and an ``except IbexError`` could miss. Each folder's
``__init__`` refuses its bare name; this checks it in a fresh interpreter started in the repo root,
where the bare names are on ``sys.path``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("broker", "client", "memory", "ops", "pipeline", "shared", "worker")

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


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> list[str]:
    """Every importable module of the folders (``data/`` holds scripts run by path, not modules)."""
    return sorted(_dotted(p) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
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
