"""The usable memory budget: the spec's subtraction, as a pure function (docs/assembly.md "Budget and token
counting").

    usable = context_window - response_reserve - safety_buffer - directive - messages
             - tool_schemas - formatter_overhead          (clamped at 0; < 256 is "constrained")

Every term arrives as a ``TokenCount`` so counts of different tokenizer families or estimate kinds
cannot be combined by accident (``TokenizerMismatch``).
"""

from __future__ import annotations

import math

from ...shared.wire.errors import TokenizerMismatch
from ...shared.wire.models import BudgetBreakdown
from ..counting.calibration import Calibration
from ..counting.tokens import ScaledCounter, TokenCount, TokenCounter
from .catalog import Catalog, ModelSpec

RESERVE_MIN = 500
RESERVE_MAX = 4096


def response_reserve(spec: ModelSpec, fraction: float = 0.15) -> int:
    """15 % of the window by default, bounded to [500, 4096], never above the model's max output."""
    reserve = max(RESERVE_MIN, min(RESERVE_MAX, math.ceil(spec.context_window * fraction)))
    return min(reserve, spec.max_output)


def safety_buffer(spec: ModelSpec, calibration: Calibration | None = None) -> int:
    """The family's fixed fraction of the window; for a calibrated key, the observed spread above
    the quantile (at least 1 %, never more than the family's fraction)."""
    frac = spec.family.safety_buffer_fraction
    if calibration is not None:
        frac = calibration.safety_fraction(frac)
    return math.ceil(spec.context_window * frac)


def room(spec: ModelSpec, spent: int, *, reserve_fraction: float = 0.15, calibration: Calibration | None = None) -> int:
    """What the window leaves after the reply's reserve, the safety buffer and ``spent`` tokens
    (negative when over): ``compute_budget``'s ``unclamped``, without building the breakdown."""
    return spec.context_window - response_reserve(spec, reserve_fraction) - safety_buffer(spec, calibration) - spent


def is_exact(spec: ModelSpec) -> bool:
    return spec.family.estimate_kind == "exact"


def multiplier(spec: ModelSpec, calibration: Calibration) -> float:
    """The multiplier a calibrated (org, model) charges, floored for the model's family."""
    return calibration.multiplier(exact=is_exact(spec), estimate_factor=spec.family.estimate_factor)


def counter_for(catalog: Catalog, spec: ModelSpec, calibration: Calibration | None) -> TokenCounter:
    """The counter a request is budgeted with: the family's own (exact BPE or the estimate with its
    factor) or, for a calibrated (org, model), that count times the learned multiplier (docs/assembly.md
    "Calibrated token counts"; never below ``pipeline.counting.calibration.multiplier_floor``)."""
    base = catalog.counter(spec.family.name)
    if calibration is None:
        return base
    return ScaledCounter(base, multiplier(spec, calibration))


def compute_budget(
    spec: ModelSpec,
    *,
    directive: TokenCount,
    messages: TokenCount,
    tool_schemas: TokenCount,
    formatter_overhead: TokenCount,
    reserve_fraction: float = 0.15,
    constrained_below: int = 256,
    calibration: Calibration | None = None,
) -> BudgetBreakdown:
    """Usable memory budget for one assembly, with every term kept for the response.

    With ``calibration`` every count must come from ``counter_for``'s calibrated counter."""
    fam = spec.family
    rule = "calibrated" if calibration is not None else fam.estimate_kind
    spent = directive + messages + tool_schemas + formatter_overhead  # raises on mixed kinds
    if spent.family != fam.name or spent.kind != rule:
        raise TokenizerMismatch(f"counts are {spent.family}/{spent.kind} but model {spec.name} uses {fam.name}/{rule}")
    reserve = response_reserve(spec, reserve_fraction)
    buffer = safety_buffer(spec, calibration)
    unclamped = spec.context_window - reserve - buffer - spent.n  # as ``room``, with the terms at hand
    usable = max(0, unclamped)
    return BudgetBreakdown(
        model=spec.name,
        tokenizer_family=fam.name,
        estimate_kind=fam.estimate_kind,
        context_window=spec.context_window,
        max_output=spec.max_output,
        response_reserve=reserve,
        safety_buffer=buffer,
        directive_tokens=directive.n,
        messages_tokens=messages.n,
        tool_schema_tokens=tool_schemas.n,
        formatter_overhead_tokens=formatter_overhead.n,
        usable=usable,
        unclamped=unclamped,
        constrained=usable < constrained_below,
        count_rule=rule,
        calibration_samples=int(calibration.samples) if calibration is not None else 0,
        calibration_quantile=calibration.quantile if calibration is not None else None,
        calibration_ratio=multiplier(spec, calibration) if calibration is not None else None,
    )
