"""Markdown tables, as every suite prints them and writes them into its report."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table as lines: the header, its rule, one line per row."""
    return [row(head), row(["---"] * len(head)), *(row(r) for r in rows)]


def ms(us: float | None, digits: int = 2) -> str:
    """Microseconds shown as milliseconds; ``-`` for a missing value."""
    return "-" if us is None else f"{us / 1000:.{digits}f}"
