"""The first pydantic error as one line: every boundary (wire codec, memory service, CLIs, seed
files, stored records) reports a ``ValidationError`` the same way, naming the field to fix
(docs/protocol.md "Errors")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pydantic import ValidationError


class FirstError(NamedTuple):
    """The first error of a ``ValidationError``: dotted field path (``root`` when the error is
    about the whole document), the message, pydantic's error type, the raw location and how many
    further errors were not reported."""

    field: str
    message: str
    kind: str
    loc: tuple[str, ...]
    more: int


def first_error(exc: ValidationError, *, root: str = "", reasons: Mapping[str, str] | None = None) -> FirstError:
    """The first error of ``exc``; ``reasons`` replaces pydantic's message for some error types
    with words that tell a caller what to fix."""
    first = exc.errors()[0]
    loc = tuple(_shown(str(p)) for p in first["loc"])
    message = first["msg"] if reasons is None else reasons.get(first["type"], first["msg"])
    return FirstError(".".join(loc) or root, message, first["type"], loc, exc.error_count() - 1)


MAX_SHOWN = 100  # a caller's key longer than this is cut in the error that names it


def _shown(part: str) -> str:
    """One location part as an error may quote it: a caller's key with a newline or control
    character is ``repr``-quoted and a long one cut, so the error stays one short line."""
    if not part.isprintable():
        part = repr(part)
    return part if len(part) <= MAX_SHOWN else part[: MAX_SHOWN - 3] + "..."
