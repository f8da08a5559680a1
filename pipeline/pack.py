"""Packing stage: choose the memories that fit the token budget with the most total score.

Spec, ranking-and-packing.md "Packing" (and milestone-packer-v2.md): a 0/1 knapsack under the
usable token budget, in seven steps (marked ``Step N`` in the code).

1. Sort by score desc, then ``memory_id`` (deterministic ties).
2. Discretize into ``bucket_size``-token buckets. Weights are rounded UP (ceil), unlike the
   milestone sketch's ``max(1, t // 16)``: a ceil-bucketed answer can never exceed the budget in
   exact tokens, so step 5 has nothing to undo, and the up to ``bucket_size - 1`` tokens per
   memory that ceil leaves unused are won back by step 6. ``bucket_size`` is the coarsest
   bucket: when the budget left for the DP allows, buckets shrink (to 1 token at 6,250 tokens
   or less) so the table keeps the spec's 100K / 16 = 6,250 columns; a DP row costs nearly the
   same at any width up to that (numpy per-call overhead dominates), while 16-token buckets
   alone lost up to 2.4 % of the optimum on random instances with a 4K budget.
   Because ceil overstates each memory by less than a bucket, the table also runs one bucket
   per row past the capacity, and the best few answers there are checked on exact tokens.
3. Numpy DP when ``rows x (buckets + 1)`` is within ``cell_ceiling`` (rows: the memories that
   fit the budget on their own). A Dembo-Hammer reduction (LP bound against a good greedy
   packing) first fixes the memories that provably are in, or out of, every optimal packing,
   so the table only has rows for the undecided core. The table is one int32 value row updated
   in place and a flat bool decision table holding only the columns each row can still reach.
4. Beyond the ceiling: score-desc greedy that stops after ``max_consecutive_skips`` misses.
5. Repair: drop memories until exact tokens fit (a guard; ceil buckets make it a no-op).
6. Refill and improve on exact tokens: add whatever fits, then one-for-one and one-for-two
   swaps that raise total score. The result is also never worse than a full score-desc greedy
   pass, which is computed anyway as one of the reduction's lower bounds.
7. Emit in score desc, then ``memory_id``.

Pure: no I/O, no clocks, no module state beyond constants. Invalid candidates (negative tokens,
scores outside [0, 1]) are a caller bug, caught by ``worker.score``; here they raise ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import attrgetter
from typing import Final

import numpy as np
import numpy.typing as npt

from ibex_context.pipeline.types import PackPath, PackResult, ScoredMemory

BUCKET_SIZE: Final = 16  # spec step 2
CELL_CEILING: Final = 70 * 6251  # spec step 3: 70 candidates x (100K / 16 + 1) columns
MAX_CONSECUTIVE_SKIPS: Final = 8  # spec step 4: greedy stops after this many misses in a row

# DP values are scores scaled to integers: exact ties (so the choice is deterministic and
# independent of float summation order) and int32 arithmetic, about 2x faster than float32 here.
# Resolution 2**-20 ~ 1e-6 per memory; the exact float scores decide in step 6.
_SCORE_SCALE: Final = 1 << 20
# Most columns the DP uses: buckets shrink below ``bucket_size`` (down to 1 token) while the
# budget left for the DP needs no more than the spec's 100K / 16 table width. Wider rows cost
# more (12,500 columns: about +25 % per row here) and gained nothing once over-capacity answers
# are checked on exact tokens.
_MAX_COLUMNS: Final = 6250
_INT32_MAX: Final = 2**31 - 1
# How many over-capacity DP answers to check on exact tokens (see _knapsack).
_OVER_CAPACITY_TRIES: Final = 3
# Above this many undecided memories, one round of swaps to tighten the bound pays for itself.
_IMPROVE_ABOVE: Final = 10
# From this many knapsack rows on, reducing first pays: it costs about as much as 20 DP rows.
_REDUCE_FROM: Final = 20
_NEVER_FITS: Final = np.iinfo(np.int64).max
# A move must gain more than this much score: float noise must never cause swap cycles.
_MIN_GAIN: Final = 1e-12

_ID_TOKENS: Final = attrgetter("hit.memory_id", "tokens")
_SCORE: Final = attrgetter("composite_score")
_TOKENS: Final = attrgetter("tokens")

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def _sorted(candidates: Sequence[ScoredMemory]) -> list[ScoredMemory]:
    """Step 1: score desc, then memory_id; tokens last so duplicate ids (a caller bug) still get
    an order independent of the input's. C-level sort keys; the id pass only when scores tie."""
    order = sorted(candidates, key=_SCORE, reverse=True)
    if len(set(map(_SCORE, order))) < len(order):
        order = sorted(candidates, key=_ID_TOKENS)
        order.sort(key=_SCORE, reverse=True)  # reverse=True keeps equal scores in id order
    return order


def pack(
    candidates: Sequence[ScoredMemory],
    token_budget: int,
    *,
    bucket_size: int = BUCKET_SIZE,
    cell_ceiling: int = CELL_CEILING,
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
) -> PackResult:
    """Pack ``candidates`` into ``token_budget`` tokens, maximizing total ``composite_score``.

    Guarantees: exact ``total_tokens <= token_budget``; the same result for any permutation of
    the input; never a lower total score than score-desc greedy. ``path`` says what ran:
    ``empty`` (no candidates, or a non-positive budget so nothing can be packed), ``all_fit``,
    ``dp``, or ``greedy`` (the DP table would exceed ``cell_ceiling`` cells). ``budget_reached``
    is true when any candidate was left out for budget (the formatter's ``was_truncated``): an
    empty candidate set is not a truncation, a non-positive budget with candidates is. The
    milestone logs a warning on the greedy fallback; this stage is pure, so its caller does.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")

    # Python lists for the O(n) bookkeeping (n <= 70 in practice: cheaper than numpy calls).
    order = _sorted(candidates)
    tokens = list(map(_TOKENS, order))
    scores = list(map(_SCORE, order))
    _check(order, tokens, scores)
    if not order:
        return _result(order, [], "empty", token_budget)
    if token_budget <= 0:
        return _result(order, [False] * len(order), "empty", token_budget)
    if sum(tokens) <= token_budget:
        return _result(order, [True] * len(order), "all_fit", token_budget)

    # Zero-token memories always go in; oversized ones never can. Neither needs a DP row.
    knap = [i for i, x in enumerate(tokens) if 0 < x <= token_budget]
    t = [tokens[i] for i in knap]
    v = [scores[i] for i in knap]
    capacity = token_budget // bucket_size  # the spec's table width, capped below when all fit
    if sum(t) <= token_budget:
        capacity = min(capacity, sum(-(-x // bucket_size) for x in t))
    path: PackPath
    if len(knap) * (capacity + 1) <= cell_ceiling:  # Step 3, else step 4
        path, taken = "dp", _solve_dp(t, v, token_budget, bucket_size)
    else:
        path = "greedy"
        sub = np.zeros(len(knap), dtype=np.bool_)
        sub[_greedy(t, range(len(knap)), token_budget, max_consecutive_skips)] = True
        t_arr, v_arr = np.array(t, dtype=np.int64), np.array(v, dtype=np.float64)
        _repair(sub, t_arr, v_arr, token_budget)  # Step 5 (a no-op: greedy counts exact tokens)
        # Step 6, its swap searches bounded in total by the same ceiling as the DP table.
        _improve(sub, t_arr, v_arr, token_budget, max_work=cell_ceiling)
        taken = sub.nonzero()[0].tolist()
    chosen = [x == 0 for x in tokens]
    for j in taken:
        chosen[knap[j]] = True
    return _result(order, chosen, path, token_budget)


def _check(order: Sequence[ScoredMemory], tokens: list[int], scores: list[float]) -> None:
    """Refuse inputs ``worker.score`` would have rejected: they would break the bounds below."""
    for m, t, s in zip(order, tokens, scores, strict=True):
        if t < 0 or not 0.0 <= s <= 1.0:  # NaN fails the comparison too
            raise ValueError(
                f"candidate {m.memory_id!r} has tokens={t!r}, composite_score={s!r}; "
                "tokens must be >= 0 and the score finite in [0, 1] (see worker.score)"
            )


def _ceil_div(a: IntArray, b: int) -> IntArray:
    return -(-a // b)


def _greedy(t: list[int], order: Iterable[int], budget: int, max_consecutive_skips: int) -> list[int]:
    """Take each memory that still fits, in ``order``; stop after that many misses in a row.

    In score order this is spec step 4, and with no skip limit the "never below greedy" floor.
    """
    taken: list[int] = []
    remaining, skips = budget, 0
    for i in order:
        if t[i] <= remaining:
            taken.append(i)
            remaining -= t[i]
            skips = 0
        else:
            skips += 1
            if skips >= max_consecutive_skips:
                break
    return taken


def _solve_dp(t_l: list[int], v_l: list[float], budget: int, bucket_size: int) -> list[int]:
    """Steps 2, 3, 5, 6 for memories that each fit (``0 < t <= budget``); returns those taken.

    1. Lower bounds: the score-desc greedy, and (from ``_REDUCE_FROM`` rows) the score-per-token
       greedy, improved by a round of one-for-one swaps when the first reduction leaves a large
       core. The better one lets ``_reduce`` decide most memories without a DP row.
    2. The DP over the undecided core. With 1-token buckets it is exact; otherwise its answer is
       repaired and improved on exact tokens (steps 5 and 6).
    3. The best of the DP answer and the lower bounds: never below greedy.
    """
    n = len(t_l)
    if sum(t_l) <= budget:
        return list(range(n))
    best = _greedy(t_l, range(n), budget, n)  # score desc: t, v arrive in score order
    best_value = sum(v_l[i] for i in best)
    t, v = np.array(t_l, dtype=np.int64), np.array(v_l, dtype=np.float64)
    if n < _REDUCE_FROM:  # the reduction would cost more than the DP rows it saves
        fixed_in, core = np.zeros(0, dtype=np.int64), np.arange(n)
    else:
        by_ratio = np.argsort(-(v / t), kind="stable").tolist()
        taken, lp_bound, ratio = _ratio_greedy(t_l, v_l, by_ratio, budget)
        value = sum(v_l[i] for i in taken)
        if value > best_value + _MIN_GAIN:
            best, best_value = taken, value
        fixed_in, core = _reduce(t, v, lp_bound, ratio, best_value)
        if core.size > _IMPROVE_ABOVE:  # a better bound is worth a swap search
            incumbent = np.zeros(n, dtype=np.bool_)
            incumbent[taken] = True
            _improve(incumbent, t, v, budget, pairs=False, max_rounds=1)
            value = float(v[incumbent].sum())
            if value > best_value + _MIN_GAIN:
                best, best_value = incumbent.nonzero()[0].tolist(), value
                fixed_in, core = _reduce(t, v, lp_bound, ratio, best_value)

    found = np.zeros(n, dtype=np.bool_)
    found[fixed_in] = True
    residual = budget - int(t[fixed_in].sum())
    core = core[t[core] <= residual]
    bucket = 1
    if core.size:
        # Finer buckets when the residual is small: the DP costs per row far more than per column.
        bucket = min(bucket_size, max(1, -(-residual // _MAX_COLUMNS)))
        weights = _ceil_div(t[core], bucket)  # ceil: the answer fits in exact tokens too
        values = np.rint(v[core] * _SCORE_SCALE).astype(np.int64)
        exact = t[core] if bucket > 1 else None  # 1-token buckets are exact already
        in_core = _knapsack(weights, values, residual // bucket, tokens=exact, limit=residual, bucket=bucket)
        found[core[in_core]] = True
    _repair(found, t, v, budget)  # Step 5
    # Step 6. 1-token buckets: the DP is exact, only refill (memories of score 0 that fit).
    _improve(found, t, v, budget, max_rounds=None if bucket > 1 else 0)
    taken = found.nonzero()[0].tolist()
    return taken if sum(v_l[i] for i in taken) > best_value - _MIN_GAIN else best


def _ratio_greedy(t: list[int], v: list[float], by_ratio: list[int], budget: int) -> tuple[list[int], float, float]:
    """Greedy in score-per-token order, and from the same pass the LP relaxation's bound and
    critical ratio (the ratio of the first memory that does not fit whole)."""
    taken: list[int] = []
    remaining = budget
    lp_bound, ratio, critical = 0.0, 0.0, False
    for i in by_ratio:
        if t[i] <= remaining:
            taken.append(i)
            remaining -= t[i]
            if not critical:
                lp_bound += v[i]
        elif not critical:
            critical, ratio = True, v[i] / t[i]
            lp_bound += remaining * ratio
    return taken, lp_bound, ratio


def _reduce(t: IntArray, v: FloatArray, lp_bound: float, ratio: float, lower: float) -> tuple[IntArray, IntArray]:
    """Memories in every optimal packing, and the undecided core (the DP's rows).

    Dembo-Hammer reduction: with r the LP relaxation's critical score-per-token ratio, forcing a
    memory against its LP choice lowers the LP bound by at least ``|v - r t|``. When that bound
    drops below ``lower`` (the value of a packing we hold), no optimum goes against the LP
    choice, so the memory needs no DP row. Memories far from the cutoff ratio, usually most of
    them, are decided this way.
    """
    excess = v - ratio * t
    decided = np.abs(excess) > lp_bound - lower + 1e-9 * max(1.0, lower)  # margin: float error
    return (decided & (excess > 0)).nonzero()[0], (~decided).nonzero()[0]


def _knapsack(
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
    w_l, v_l = weights.tolist(), values.tolist()
    left = sum(w_l)
    low = min(capacity, left)
    high = low
    if tokens is not None:  # a set can overshoot by at most the rows' total rounding
        high = min(left, capacity + m, (limit + int((weights * bucket - tokens).sum())) // bucket)
    if high <= 0:
        return np.zeros(m, dtype=np.bool_)
    # Plain Python for the per-row bookkeeping: at <= 70 rows it beats a dozen numpy calls.
    plan: list[tuple[int, int, int, int, int]] = []  # (memory, weight, first column, width, offset)
    size = 0
    for i in sorted(range(m), key=w_l.__getitem__, reverse=True):  # heaviest first: R_i falls fastest
        w = w_l[i]
        left -= w  # R_i: the weight of the rows after this one
        first = max(w, low - left)
        width = max(0, high + 1 - first)
        plan.append((i, w, first, width, size))
        size += width
    vals = np.array(v_l, dtype=np.int32 if sum(v_l) <= _INT32_MAX else np.int64)
    best = np.zeros(high + 1, dtype=vals.dtype)
    keep = np.empty(size, dtype=np.bool_)
    end = high + 1
    for i, w, first, width, at in plan:
        if width:
            take = best[first - w : end - w] + vals[i, ...]  # 0-d operand: the cheapest ufunc call
            seg = best[first:]
            np.greater(take, seg, out=keep[at : at + width])
            np.maximum(seg, take, out=seg)

    sizes = tokens.tolist() if tokens is not None else w_l

    def backtrack(c: int, room: int) -> list[int] | None:
        """The rows taken for capacity ``c``, or None once their exact size passes ``room``."""
        taken: list[int] = []
        for i, w, first, width, at in reversed(plan):
            if width and c >= first and keep[at + c - first]:
                taken.append(i)
                c -= w
                room -= sizes[i]
                if room < 0:
                    return None
        return taken

    chosen = None
    if tokens is not None and high > low:
        rises = (best[low + 1 :] > best[low:-1]).nonzero()[0] + (low + 1)  # best value rises here
        for c in reversed(rises[-_OVER_CAPACITY_TRIES:].tolist()):  # best value first
            chosen = backtrack(c, limit)
            if chosen is not None:
                break
    if chosen is None:
        chosen = backtrack(low, sum(sizes))  # fits: ceil weights never understate
    taken = np.zeros(m, dtype=np.bool_)
    taken[chosen] = True
    return taken


def _repair(chosen: BoolArray, t: IntArray, v: FloatArray, budget: int) -> None:
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


def _improve(
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
    stranded). Each applied swap raises the total by more than ``_MIN_GAIN``, so the loop ends;
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
    """The (leaving, entering) swap with the largest gain above ``_MIN_GAIN`` that fits, if any,
    and how many combinations were examined (searches that would exceed ``work_left`` are skipped).
    """
    t_in, v_in, t_out, v_out = t[ins], v[ins], t[outs], v[outs]
    room = t_in + slack  # what may enter when that chosen memory leaves
    best_gain = _MIN_GAIN
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


def _result(order: list[ScoredMemory], chosen: list[bool], path: PackPath, budget: int) -> PackResult:
    """Step 7: emit in score desc, then memory_id (``order`` is already sorted that way)."""
    packed = tuple(compress(order, chosen))
    excluded = tuple(compress(order, [not c for c in chosen]))
    return PackResult(
        packed=packed,
        excluded=excluded,
        path=path,
        evaluated=len(order),
        excluded_for_budget=len(excluded),
        budget_reached=bool(excluded),
        total_tokens=sum(map(_TOKENS, packed)),
        total_score=math.fsum(map(_SCORE, packed)),
        token_budget=budget,
    )
