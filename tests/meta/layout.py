"""The package's layout as pyproject.toml declares it: which folder holds which ``ibex_context`` name.

The checkout is the package (its ``__init__.py`` at the root) and ``[tool.setuptools.package-dir]``
names each top-level folder as one of its subpackages; the meta tests read the same table the wheel
and the editable install are built from, so a folder added there is checked without editing them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ibex_context"
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, Path] = {name: ROOT / folder for name, folder in _SETUPTOOLS["package-dir"].items()}
PACKAGES: list[str] = list(_SETUPTOOLS["packages"])
FOLDERS: tuple[str, ...] = tuple(sorted(name.split(".", 1)[1] for name in PACKAGE_DIRS if name != PACKAGE))


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package (``data/`` holds scripts run by path)."""
    found = {PACKAGE: PACKAGE_DIRS[PACKAGE] / "__init__.py"}
    for top, folder in PACKAGE_DIRS.items():
        if top == PACKAGE:
            continue
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if "data" in parts:
                continue
            found[".".join((top, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found
