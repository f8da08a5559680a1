"""Code stays readable by construction: no function over 60 lines (docs/architecture.md "Processes
and data flow"). ruff holds each function to a complexity of 10, 12 branches, 50 statements and 8
arguments (pyproject.toml). A module is split by what its functions do, not by a line count: a cap
on module length split classes into mixins for length alone. bench/ and tests/ are exempt."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["client", "shared", "broker", "worker", "memory", "ops", "pipeline"]
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "data" not in p.parts)


def test_the_packages_are_there() -> None:
    assert len(_modules()) > 40  # the check below must look at the real tree


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_function_sizes(path: Path) -> None:
    text = path.read_text("utf-8")
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"  # type: ignore[operator]
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]  # type: ignore[operator]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
