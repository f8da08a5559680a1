"""Who a memory is about, and whether a question names them (docs/memory-search.md "Subjects").

A memory's subject is the ``subject`` its writer gave, else the speaker of a dialog turn written as
``"Name: text"`` (one to three capitalised words before a colon at the start). It is derived when
read, so memories stored without one are covered without rewriting them. A question names a
subject when every word of the subject's first name occurs among the question's words (case and
width folded): "When did Jonah's dad visit?" names "Jonah". Search lifts the memories about a
person the question names (``memory.search.fusion.boosted``): questions about people are mostly answered
by what those people said.

Pure: no I/O.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection
from functools import lru_cache

_SPEAKER = re.compile(r"^\s*([A-Z][\w'’.-]{0,30}(?: [A-Z][\w'’.-]{0,30}){0,2})\s*:\s")
_WORD = re.compile(r"\w+", re.UNICODE)


def normalize(text: str) -> str:
    """NFKC + casefold, as the full-text side folds words (``memory.embedders.embed.normalize``)."""
    return unicodedata.normalize("NFKC", text).casefold()


def derive_subject(content: str) -> str | None:
    """The speaker of a ``"Name: text"`` turn, or None."""
    m = _SPEAKER.match(content)
    return m.group(1) if m is not None else None


def subject_of(subject: str | None, content: str) -> str | None:
    """The memory's subject: the one written with it, else the one its content shows."""
    return subject if subject else derive_subject(content)


def question_words(question: str) -> frozenset[str]:
    """The question's words, folded as subjects are compared."""
    return frozenset(_WORD.findall(normalize(question)))


@lru_cache(maxsize=65_536)
def first_name(subject: str) -> str | None:
    """The subject's first word, folded (None when it has none): what a question must name."""
    found = _WORD.search(normalize(subject))
    return found.group() if found is not None else None


def names(words: Collection[str], subject: str | None) -> bool:
    """Whether a question with ``words`` names ``subject`` (its first name)."""
    first = first_name(subject) if subject else None
    return first is not None and first in words
