"""Where a search's answer ends, and the candidates just under that line (docs/memory-search.md).

A search answers the ``limit`` best candidates by composite whose relevance reaches the floor. The
next few under that line (``IBEX_MEMORY_BELOW_CUTOFF``: past the limit, under the floor, or, when
those are fewer, the vector candidates under the cosine cutoff that matched no question word) are
sent beside the answer with their scores and why they missed it, and ``explain`` shows them, so
"why is my memory not there?" has an answer. They are never packed.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

BELOW_CUTOFF_SHOWN = 5  # IBEX_MEMORY_BELOW_CUTOFF: candidates under the line a search sends


def cut(order: Sequence[int], relevance: Sequence[float], *, floor: float, limit: int, shown: int
        ) -> tuple[list[int], list[tuple[int, str]]]:
    """Split candidates (positions, best composite first) into the answer and the first ``shown``
    under the line, each with its reason."""
    kept: list[int] = []
    below: list[tuple[int, str]] = []
    for i in order:
        if relevance[i] < floor:
            if len(below) < shown:
                below.append((i, f"relevance {relevance[i]:.3f} is under the floor {floor:g}"))
        elif len(kept) < limit:
            kept.append(i)
        elif len(below) < shown:
            below.append((i, f"ranked {len(kept) + len(below) + 1}, after the {limit} hits the search returns"))
        if len(kept) >= limit and len(below) >= shown:
            break
    return kept, below


def cosine_reason(cosine: float, min_similarity: float) -> str:
    """Why a vector candidate that matched no question word was not ranked."""
    return f"cosine {cosine:.3f} is under the cutoff {min_similarity:g} and it holds no word of the question"
