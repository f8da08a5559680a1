"""Memories as the store holds them (pydantic v2, strict): ``MemoryRecord`` and the field types
it shares with the service's request bodies.

Strict like the wire models: a string where a number belongs is a caller bug, not something to
coerce; NaN and infinity are refused; unknown fields are refused.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

from ...pipeline.selection.hits import MAX_CONTENT_CHARS  # one memory-hit contract: stored as read
from ...shared.wire.models import Ident
from ..search.rank import CATEGORIES

Unit = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Category = Literal["fact", "preference", "relationship", "skill", "note", "event", "task"]
assert set(get_args(Category)) == CATEGORIES  # keep rank.py's half-life table in step
# Timestamps outside this range are refused on write and skipped on read: near datetime's limits
# (years 1 and 9999) converting one to UTC or to epoch seconds raises OverflowError, and no memory
# is that old or that new. 1900 leaves room for the seed format's age_days (up to 100 years).
CREATED_AT_MIN = datetime(1900, 1, 1, tzinfo=UTC)
CREATED_AT_MAX = datetime(2200, 1, 1, tzinfo=UTC)
# Content may hold tab, newline and carriage return; no other control character (Unicode Cc:
# C0, DEL, C1). Each would come back JSON-escaped at six bytes, bloating every read of the agent.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _sane_timestamp(ts: datetime) -> datetime:
    if not CREATED_AT_MIN <= ts < CREATED_AT_MAX:
        raise ValueError(f"must be from {CREATED_AT_MIN.year} up to (not including) {CREATED_AT_MAX.year} UTC")
    return ts


def _no_controls(text: str) -> str:
    found = _CONTROL.search(text)
    if found is not None:
        raise ValueError(f"control character U+{ord(found.group()):04X} at position {found.start()} is not "
                         "allowed (only tab, newline and carriage return)")
    return text


# created_at arrives as an ISO-8601 string in JSON: lax parsing for this one field only.
Timestamp = Annotated[AwareDatetime, Field(strict=False), AfterValidator(_sane_timestamp)]
Content = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CONTENT_CHARS), AfterValidator(_no_controls)]
# Who a memory is about (memory.search.subjects): a person's or thing's name, one line.
MAX_SUBJECT_CHARS = 64
Subject = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SUBJECT_CHARS, strip_whitespace=True),
                    AfterValidator(_no_controls)]


def iso(ts: datetime) -> str:
    """UTC ISO-8601 with a ``Z``, the one timestamp format on this service's wire."""
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class StrictModel(BaseModel):
    # pydantic also refuses lone surrogates in strings (legal JSON escapes, unstorable as UTF-8).
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class MemoryRecord(StrictModel):
    """One memory as stored at ``{org}:memories:{agent}`` (field ``memory_id``)."""

    memory_id: Ident
    content: Content
    category: Category
    confidence: Unit
    usefulness: Unit = 0.5
    access_count: Annotated[int, Field(ge=0, le=10**9)] = 0
    created_at: Timestamp
    salience: Unit = 0.5
    subject: Subject | None = None  # who the memory is about, as its writer said (memory.search.subjects)

    def hit(self, *, similarity: float, rank: int) -> dict[str, Any]:
        """The JSON object the HTTP contract returns for this memory."""
        return {
            "memory_id": self.memory_id,
            "content": self.content,
            "category": self.category,
            "similarity": round(min(max(similarity, 0.0), 1.0), 6),
            "confidence": self.confidence,
            "rank": rank,
            "created_at": iso(self.created_at),
            "usefulness": self.usefulness,
            "access_count": self.access_count,
        }
