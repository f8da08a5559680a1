"""The exact 0/1 knapsack table of the packer's step 3 (docs/assembly.md "Scoring and packing").

One int value row updated in place per memory and a flat bool decision table holding only the
columns each row can still reach; ``pipeline.selection.pack`` decides when to call it and on which rows.
Pure: numpy over integers, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_INT32_MAX: Final = 2**31 - 1
# How many over-capacity DP answers to check on exact tokens (see knapsack).
_OVER_CAPACITY_TRIES: Final = 3


@dataclass(frozen=True, slots=True)
class _Row:
    """One memory's row: its weight, the first column it can reach, and where its decisions sit."""

    memory: int
    weight: int
    first: int
    width: int
    offset: int


@dataclass(frozen=True, slots=True)
class _Table:
    """The filled table: best value per column, the decision bits and the rows that made them."""

    best: npt.NDArray[np.int64] | npt.NDArray[np.int32]
    keep: BoolArray
    rows: list[_Row]


def knapsack(
    weights: IntArray,
    values: IntArray,
    capacity: int,
    *,
    tokens: IntArray | None = None,
    limit: int = 0,
    bucket: int = 1,
) -> BoolArray:
    """Exact 0/1 knapsack over positive integer weights; returns the taken mask.

    One value row updated in place per memory (``a[c] = max(a[c], a[c - w] + v)``, numpy over
    all columns at once) and a flat bool decision table. Row i only needs the columns at or above
    ``capacity - R_i`` (R_i = weight of the rows after it), so later rows are narrower. Ties keep
    the earlier choice (strict ``>``): the answer is a deterministic function of the input order.

    With ``tokens`` (exact sizes), ``limit`` (exact budget) and the ``bucket`` that turned
    tokens into ``weights``, the table also runs past ``capacity`` by up to the rows' total
    rounding (at most a bucket each): such a set may still fit exactly. Where the best value
    rises past ``capacity``, the best few sets are checked on exact tokens; the set at
    ``capacity`` always fits.
    """
    m = weights.size
    w_l = weights.tolist()
    low = min(capacity, sum(w_l))
    high = low
    if tokens is not None:  # a set can overshoot by at most the rows' total rounding
        high = min(sum(w_l), capacity + m, (limit + int((weights * bucket - tokens).sum())) // bucket)
    if high <= 0:
        return np.zeros(m, dtype=np.bool_)
    table = _fill(w_l, values.tolist(), _plan(w_l, low, high), high)
    sizes = tokens.tolist() if tokens is not None else w_l
    chosen = None
    if tokens is not None and high > low:
        rises = (table.best[low + 1 :] > table.best[low:-1]).nonzero()[0] + (low + 1)  # best value rises here
        for c in reversed(rises[-_OVER_CAPACITY_TRIES:].tolist()):  # best value first
            chosen = _backtrack(table, c, limit, sizes)
            if chosen is not None:
                break
    if chosen is None:
        chosen = _backtrack(table, low, sum(sizes), sizes)  # fits: ceil weights never understate
    taken = np.zeros(m, dtype=np.bool_)
    taken[chosen or []] = True
    return taken


def _plan(w_l: list[int], low: int, high: int) -> list[_Row]:
    """Rows heaviest first (R_i falls fastest), each with the columns it can still reach.

    Plain Python for the per-row bookkeeping: at <= 70 rows it beats a dozen numpy calls.
    """
    left = sum(w_l)
    rows: list[_Row] = []
    size = 0
    for i in sorted(range(len(w_l)), key=w_l.__getitem__, reverse=True):
        w = w_l[i]
        left -= w  # R_i: the weight of the rows after this one
        first = max(w, low - left)
        width = max(0, high + 1 - first)
        rows.append(_Row(i, w, first, width, size))
        size += width
    return rows


def _fill(w_l: list[int], v_l: list[int], rows: list[_Row], high: int) -> _Table:
    """Run the DP: one value row updated in place, each row's decisions into its slice of ``keep``."""
    vals = np.array(v_l, dtype=np.int32 if sum(v_l) <= _INT32_MAX else np.int64)
    best = np.zeros(high + 1, dtype=vals.dtype)
    keep = np.empty(sum(r.width for r in rows), dtype=np.bool_)
    end = high + 1
    for r in rows:
        if r.width:
            take = best[r.first - r.weight : end - r.weight] + vals[r.memory, ...]  # 0-d: the cheapest ufunc call
            seg = best[r.first:]
            np.greater(take, seg, out=keep[r.offset : r.offset + r.width])
            np.maximum(seg, take, out=seg)
    return _Table(best, keep, rows)


def _backtrack(table: _Table, c: int, room: int, sizes: list[int]) -> list[int] | None:
    """The rows taken for capacity ``c``, or None once their exact size passes ``room``."""
    taken: list[int] = []
    keep = table.keep
    for r in reversed(table.rows):
        if r.width and c >= r.first and keep[r.offset + c - r.first]:
            taken.append(r.memory)
            c -= r.weight
            room -= sizes[r.memory]
            if room < 0:
                return None
    return taken
