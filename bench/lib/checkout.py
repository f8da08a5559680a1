"""Another checkout of the project as a bench's child processes import it (``--baseline``).

Putting a checkout on ``PYTHONPATH`` is not enough: the editable install of this checkout maps
``ibex_context`` and its folders to this checkout, and any name the other checkout does not hold
at a path Python searches first falls through to it (a baseline would then run today's code and
every before/after would compare a build with itself). So a baseline is imported through a view:
a folder whose ``ibex_context`` is the other checkout's package, laid out the way that checkout's
``pyproject.toml`` lays it out (the checkout itself as the package, folders mapped by
``package-dir``, or an ``ibex_context/`` folder of its own). A checkout whose packages are
top-level folders (``shared``, ``worker``: no ``ibex_context`` at all) gets a view with only the
start-up file; the checkout itself, next on the path, serves its packages.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

PACKAGE = "ibex_context"


def _package_dirs(root: Path) -> dict[str, str]:
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    setuptools = tomllib.loads(pyproject.read_text("utf-8")).get("tool", {}).get("setuptools", {})
    dirs = setuptools.get("package-dir", {})
    return {str(k): str(v) for k, v in dirs.items()} if isinstance(dirs, dict) else {}


# Run at the child's start (after the .pth files): the editable install of the bench's own checkout
# must not serve a module the baseline lacks.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
"""


def _view(root: Path, dirs: dict[str, str]) -> Path:
    """A folder holding ``ibex_context`` as ``root`` lays it out (made afresh on every call)."""
    view = Path(tempfile.gettempdir()) / f"ibex-baseline-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    (view / "sitecustomize.py").write_text(SITECUSTOMIZE, "utf-8")
    top = root / dirs.get(PACKAGE, PACKAGE)
    if not top.is_dir():  # top-level packages: the checkout on the path serves them
        return view
    if top.resolve() == root:  # the checkout is the package
        (view / PACKAGE).symlink_to(root, target_is_directory=True)
        return view
    package = view / PACKAGE
    package.mkdir()
    for item in top.iterdir():
        if item.name != "__pycache__":
            (package / item.name).symlink_to(item)
    for name, folder in dirs.items():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == PACKAGE and not (package / parts[1]).exists():
            (package / parts[1]).symlink_to(root / folder, target_is_directory=True)
    return view


def pythonpath(checkout: str | Path) -> str:
    """``PYTHONPATH`` for a child that must run ``checkout``'s code: its package view first, then the
    checkout itself (for its ``bench``)."""
    root = Path(checkout).resolve()
    if not (root / "pyproject.toml").is_file():
        raise ValueError(f"{root} is not a checkout of the project (no pyproject.toml)")
    # without a package-dir table, an ibex_context/ folder of its own (real or linked) is the package
    return os.pathsep.join((str(_view(root, _package_dirs(root))), str(root)))


def checkout_of(path_entry: str) -> Path:
    """The checkout a ``pythonpath`` value was made for (its last entry)."""
    return Path(path_entry.split(os.pathsep)[-1])


def memory_server_module(checkout: str | Path | None) -> str:
    """The memory service's ``-m`` module in ``checkout`` (today's when None): it moved between layouts."""
    root = Path(checkout).resolve() if checkout is not None else Path(__file__).resolve().parents[2]
    for rel, module in (("memory/service/server.py", "ibex_context.memory.service.server"),
                        ("memory/server.py", "ibex_context.memory.server")):
        if (root / rel).is_file():
            return module
    raise ValueError(f"{root} holds no memory service")
