"""Packing stage: choose the memories that fit the token budget with the most total score.

docs/assembly.md "Scoring and packing": a 0/1 knapsack under the usable token budget, in seven steps
(marked ``Step N`` in the code). The DP table lives in ``pipeline.selection.knapsack``, steps 5 and 6 in
``pipeline.selection.swaps``.

1. Sort by score desc, then ``memory_id`` (deterministic ties).
2. Discretize into ``bucket_size``-token buckets. Weights are rounded UP (ceil), unlike the
   original sketch's ``max(1, t // 16)``: a ceil-bucketed answer can never exceed the budget in
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
scores outside [0, 1]) are a caller bug, caught by ``pipeline.selection.score``; here they raise ValueError.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter
from typing import Final

import numpy as np

from ...shared.wire.models import PackPath
from ..types import PackResult, ScoredMemory
from .knapsack import FloatArray, IntArray, knapsack
from .swaps import MIN_GAIN, improve, repair

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
# Above this many undecided memories, one round of swaps to tighten the bound pays for itself.
_IMPROVE_ABOVE: Final = 10
# From this many knapsack rows on, reducing first pays: it costs about as much as 20 DP rows.
_REDUCE_FROM: Final = 20

_ID_TOKENS: Final = attrgetter("hit.memory_id", "tokens")
_SCORE: Final = attrgetter("composite_score")
_TOKENS: Final = attrgetter("tokens")


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
    empty candidate set is not a truncation, a non-positive budget with candidates is. A
    warning on the greedy fallback is the caller's to log: this stage is pure.
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
        path, taken = "greedy", _solve_greedy(t, v, token_budget, max_consecutive_skips, cell_ceiling)
    chosen = [x == 0 for x in tokens]
    for j in taken:
        chosen[knap[j]] = True
    return _result(order, chosen, path, token_budget)


def _solve_greedy(t: list[int], v: list[float], budget: int, max_consecutive_skips: int,
                  cell_ceiling: int) -> list[int]:
    """Steps 4-6 beyond the cell ceiling: score-desc greedy, then repair and improve on exact tokens."""
    sub = np.zeros(len(t), dtype=np.bool_)
    sub[_greedy(t, range(len(t)), budget, max_consecutive_skips)] = True
    t_arr, v_arr = np.array(t, dtype=np.int64), np.array(v, dtype=np.float64)
    repair(sub, t_arr, v_arr, budget)  # Step 5 (a no-op: greedy counts exact tokens)
    # Step 6, its swap searches bounded in total by the same ceiling as the DP table.
    improve(sub, t_arr, v_arr, budget, max_work=cell_ceiling)
    taken: list[int] = sub.nonzero()[0].tolist()
    return taken


def _check(order: Sequence[ScoredMemory], tokens: list[int], scores: list[float]) -> None:
    """Refuse inputs ``pipeline.selection.score`` would have rejected: they would break the bounds below."""
    # C-level passes for the usual sound input (NaN fails both comparisons); the loop names a culprit
    if (not tokens or min(tokens) >= 0) and all(map(operator.le, repeat(0.0), scores)) \
            and all(map(operator.ge, repeat(1.0), scores)):
        return
    for m, t, s in zip(order, tokens, scores, strict=True):
        if t < 0 or not 0.0 <= s <= 1.0:  # NaN fails the comparison too
            raise ValueError(
                f"candidate {m.memory_id!r} has tokens={t!r}, composite_score={s!r}; "
                "tokens must be >= 0 and the score finite in [0, 1] (see pipeline.selection.score)"
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
        if value > best_value + MIN_GAIN:
            best, best_value = taken, value
        fixed_in, core = _reduce(t, v, lp_bound, ratio, best_value)
        if core.size > _IMPROVE_ABOVE:  # a better bound is worth a swap search
            incumbent = np.zeros(n, dtype=np.bool_)
            incumbent[taken] = True
            improve(incumbent, t, v, budget, pairs=False, max_rounds=1)
            value = float(v[incumbent].sum())
            if value > best_value + MIN_GAIN:
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
        in_core = knapsack(weights, values, residual // bucket, tokens=exact, limit=residual, bucket=bucket)
        found[core[in_core]] = True
    repair(found, t, v, budget)  # Step 5
    # Step 6. 1-token buckets: the DP is exact, only refill (memories of score 0 that fit).
    improve(found, t, v, budget, max_rounds=None if bucket > 1 else 0)
    taken = found.nonzero()[0].tolist()
    return taken if sum(v_l[i] for i in taken) > best_value - MIN_GAIN else best


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
