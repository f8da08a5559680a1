"""Steps 5 and 6 of the packer on exact tokens (docs/assembly.md "Scoring and packing"): repair a chosen
set until it fits, then refill and apply score-raising swaps.

Pure: numpy over the candidates' exact tokens and scores, in place on a bool mask.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from .knapsack import BoolArray, FloatArray, IntArray

_NEVER_FITS: Final = np.iinfo(np.int64).max
# A move must gain more than this much score: float noise must never cause swap cycles.
MIN_GAIN: Final = 1e-12


def repair(chosen: BoolArray, t: IntArray, v: FloatArray, budget: int) -> None:
    """Step 5, in place: drop the lowest score-per-token memories until exact tokens fit.

    Ceil buckets already make the DP answer fit; this is the guard the spec asks for.
    """
    excess = int(t[chosen].sum()) - budget
    if excess <= 0:
        return
    idx = np.flatnonzero(chosen)
    for i in idx[np.argsort(v[idx] / t[idx], kind="stable")].tolist():
        chosen[i] = False
        excess -= int(t[i])
        if excess <= 0:
            return


def improve(
    chosen: BoolArray,
    t: IntArray,
    v: FloatArray,
    budget: int,
    *,
    max_work: int | None = None,
    pairs: bool = True,
    max_rounds: int | None = None,
) -> None:
    """Step 6, in place: refill, then apply the best-gain swap on exact tokens until none helps.

    Refill adds any memory that still fits (score order). Swaps: one chosen memory for one other,
    or one chosen for two others (this is what recovers the tokens ceil buckets or a greedy pass
    stranded). Each applied swap raises the total by more than ``MIN_GAIN``, so the loop ends;
    it is also capped at n rounds. ``max_work`` caps the swap combinations examined over the
    whole call (greedy path, where n may be large: the searches are O(n^2) and O(n^3) per round).
    """
    work_left = math.inf if max_work is None else max_work
    slack = _refill(chosen, t, budget - int(t[chosen].sum()))
    for _ in range(t.size + 1 if max_rounds is None else max_rounds):
        ins, outs = chosen.nonzero()[0], (~chosen).nonzero()[0]
        if ins.size == 0 or outs.size == 0:
            return
        move, work = _best_swap(t, v, ins, outs, slack, work_left, pairs)
        work_left -= work
        if move is None:
            return
        leaving, entering = move
        chosen[leaving] = False
        chosen[entering] = True
        slack = _refill(chosen, t, slack + int(t[leaving].sum()) - int(t[entering].sum()))


def _refill(chosen: BoolArray, t: IntArray, slack: int) -> int:
    """Add, in score order, every memory that still fits; return the slack left."""
    for i in (~chosen & (t <= slack)).nonzero()[0].tolist():
        ti = int(t[i])
        if ti <= slack:
            chosen[i] = True
            slack -= ti
    return slack


def _best_swap(
    t: IntArray, v: FloatArray, ins: IntArray, outs: IntArray, slack: int, work_left: float, pairs: bool
) -> tuple[tuple[list[int], list[int]] | None, int]:
    """The (leaving, entering) swap with the largest gain above ``MIN_GAIN`` that fits, if any,
    and how many combinations were examined (searches that would exceed ``work_left`` are skipped).
    """
    t_in, v_in, t_out, v_out = t[ins], v[ins], t[outs], v[outs]
    room = t_in + slack  # what may enter when that chosen memory leaves
    best_gain = MIN_GAIN
    move: tuple[list[int], list[int]] | None = None
    work = ins.size * outs.size
    if work <= work_left:  # one for one
        gain = np.where(t_out <= room[:, None], v_out - v_in[:, None], -np.inf)
        k = int(np.argmax(gain))
        if gain.flat[k] > best_gain:
            a, b = divmod(k, outs.size)
            best_gain, move = float(gain.flat[k]), ([int(ins[a])], [int(outs[b])])
    else:
        work = 0
    if not pairs or outs.size < 2:
        return move, work
    # One for two: only a chosen memory whose room holds the two smallest others can leave, and
    # only memories that fit beside the smallest other in the largest room can enter.
    smallest = np.partition(t_out, 1)[:2]
    leave = (room >= int(smallest.sum())).nonzero()[0]
    if leave.size == 0:
        return move, work
    pool = outs[t_out <= int(room[leave].max()) - int(smallest[0])]
    p = pool.size
    if p >= 2 and work + leave.size * p * p <= work_left:
        work += leave.size * p * p
        tp, vp = t[pool], v[pool]
        pair_t = tp[:, None] + tp
        pair_t.flat[:: p + 1] = _NEVER_FITS  # a memory cannot enter twice; (b, c) = (c, b) is harmless
        gain = np.where(pair_t <= room[leave, None, None], vp[:, None] + vp - v_in[leave, None, None], -np.inf)
        k = int(np.argmax(gain))
        if gain.flat[k] > best_gain:
            a, rest = divmod(k, p * p)
            b, c = divmod(rest, p)
            move = ([int(ins[leave[a]])], [int(pool[b]), int(pool[c])])
    return move, work
