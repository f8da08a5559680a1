"""docs/settings.md is the settings tree's own reference: regenerated, it must match, and it names
every IBEX_* variable the code reads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ibex_context.ops import settings_doc

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "settings.md"
PACKAGES = ("broker", "worker", "client", "shared", "pipeline", "memory", "ops")


def test_the_page_is_in_step_with_the_fields() -> None:
    assert PAGE.read_text("utf-8") == settings_doc.render(), (
        "docs/settings.md is stale: python -m ibex_context.ops.settings_doc > docs/settings.md")


def test_the_generator_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "ibex_context.ops.settings_doc"], capture_output=True,
                         text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout == PAGE.read_text("utf-8")  # the environment does not change the page


def test_every_row_has_a_default_roles_and_a_description() -> None:
    rows = settings_doc.rows()
    assert len({r.name for r in rows}) == len(rows)
    for row in rows:
        assert row.name.startswith("IBEX_") and row.default and row.roles and row.description, row
        assert set(row.roles) <= {"broker", "worker", "client", "memory", "ops"}, row
    by_name = {r.name: r for r in rows}
    assert by_name["IBEX_CLIENT_TIMEOUT_MS"].roles == ["client"]
    assert by_name["IBEX_RETRIEVAL_TIMEOUT_MS"].roles == ["worker"]
    assert by_name["IBEX_CONTEXT_TIMEOUT"].roles == ["worker", "client"]
    assert "Deprecated" in by_name["IBEX_CONTEXT_TIMEOUT"].description
    assert by_name["IBEX_MEMORY_SECRET"].roles == ["worker", "memory"]
    assert by_name["IBEX_RUN_DIR"].roles == ["ops"]


def test_every_variable_the_code_names_is_on_the_page() -> None:
    named: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            named |= set(re.findall(r"IBEX_[A-Z0-9_]*[A-Z0-9]\b", path.read_text("utf-8")))
    missing = named - settings_doc.documented()
    assert not missing, f"IBEX_* names in the code but not in docs/settings.md: {sorted(missing)}"
