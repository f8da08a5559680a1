"""What of a memory the full-text side searches: its content with the day it was written
(docs/memory-search.md "Dates").

The text the engine indexes (BM25) is the content followed by the memory's date in words,
``"Priya: we adopted her! (4 July 2023)"``, so a question that names a month or a year ("what
happened in July 2023?", "since October 2023") matches memories of that time by their words. The
vector side embeds the content alone: with the date in the embedded text, MiniLM ranked questions
worded unlike their answers lower (measured on the conversation set, docs/memory-search.md). Only
the search sees the date: the content stored and returned is the writer's, unchanged. Memories
stored before the date was indexed keep their undated text and stay searchable.

Pure: no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime

DATE_WORDS = 3  # day, month and year: the words the date adds to the indexed text
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def date_words(ts: datetime) -> str:
    """``"4 July 2023"``: the UTC day of ``ts`` as words (locale-independent)."""
    day = ts.astimezone(UTC)
    return f"{day.day} {_MONTHS[day.month - 1]} {day.year}"


def searched_text(content: str, created_at: datetime) -> str:
    """The text the engine indexes for a memory (see the module)."""
    return f"{content} ({date_words(created_at)})"
