"""The render stage: the memories block, the target's render of it, and the count of exactly what
is emitted, never over window - response reserve.

The budget is additive in what the target sends, so the packed memories cannot push the prompt
over the window while every bound holds. Should one be wrong, the emitted prompt's own count
decides: pack again with the overshoot taken off (``MAX_REPACKS`` times), then drop the
lowest-scored memory until it fits, re-rendering each time, so the reply's messages, ``packed``
and totals always come from one render; with nothing left to drop, ``Internal``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...shared.wire.errors import Internal
from .. import format as fmt
from ..conversation.fit import Plan
from ..counting.count import LineCache, fit_memory_section, memory_tokens_bound
from ..counting.tokens import TokenCounter
from ..selection.pack import pack
from ..types import PackResult, ScoredMemory
from .render import Block, Emitted, Renderer

MAX_REPACKS = 3


@dataclass(frozen=True, slots=True)
class Nonce:
    """How the memories block's nonce is chosen: ``value`` as is unless ``derive`` (then from the
    packed memories' lines with ``key``)."""

    value: str
    derive: bool
    key: bytes | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """The render stage's output: the packing rendered, its block, the render and its count."""

    result: PackResult
    block: Block
    emitted: Emitted
    total: int


def block_nonce(rendered: list[str], lines: LineCache | None, nonce: Nonce) -> str:
    """The memories block's nonce, chosen before the block is rendered (``rendered``: the packed
    memories' lines).

    Derived from the packed memories' lines (``fmt.derive_nonce``): the same memories give the
    same block bytes turn after turn (docs/assembly.md "Prompt caching"). The given value stands when the
    caller fixed it, the request asks for ``"random"``, or nothing was packed. The budget's frame
    overhead is a bound over every nonce value, so it holds for the derived one.
    """
    if not nonce.derive or not rendered:
        return nonce.value
    key = nonce.key if nonce.key is not None else fmt.process_nonce_key()
    return lines.nonce(key, rendered) if lines is not None else fmt.derive_nonce(key, rendered)


def memory_block(result: PackResult, counter: TokenCounter, nonce: Nonce, overhead: int, lines: LineCache | None, *,
                 verify: bool) -> Block:
    """The block by the exact re-count (``verify``) or by the additive bound the budget used."""
    render = lines.line if lines is not None else fmt.memory_line
    rendered = [render(m.hit) for m in result.packed]
    value = block_nonce(rendered, lines, nonce)
    if verify:
        fitted = fit_memory_section(counter, result.packed, value, result.total_tokens + overhead)
        return Block(fitted.text, fitted.tokens, value, fitted.kept, fitted.dropped)
    kept = list(result.packed)
    text = fmt.memory_section_of(rendered, value)
    return Block(text, memory_tokens_bound(counter, result.total_tokens, overhead) if kept else 0, value, kept, [])


def emit_stage(plan: Plan[Renderer], scored: list[ScoredMemory], result: PackResult, counter: TokenCounter, *,
               nonce: Nonce, lines: LineCache | None, verify: bool, breakpoints: bool) -> Output:
    """Render ``result`` and count it; repack, then drop memories, while it is over the limit: the
    window less the response reserve, as the plan's budget has them."""
    renderer = plan.counted.renderer
    limit = plan.budget.context_window - plan.budget.response_reserve

    def once(result: PackResult) -> Output:
        block = memory_block(result, counter, nonce, plan.memory_overhead, lines, verify=verify)
        out = renderer.render(plan.fit, plan.directive, plan.directive_text, block, breakpoints=breakpoints,
                              summary=plan.summary.block if plan.summary is not None else None,
                              clearing=plan.clearing)
        return Output(result, block, out, renderer.count(out, counter, block=block))

    emitted = once(result)
    for _ in range(MAX_REPACKS):
        if emitted.total <= limit or not emitted.result.packed:
            break
        # A bound was wrong (it never has been in the tests): pack again with the overshoot removed.
        emitted = once(pack(scored, max(0, emitted.result.token_budget - (emitted.total - limit))))
    while emitted.total > limit and emitted.result.packed:  # the repacks did not converge
        emitted = once(without_lowest(emitted.result))
    if emitted.total > limit:
        raise Internal(f"the emitted prompt counts {emitted.total} tokens, over the {limit} the window allows, "
                       "with no memories left to drop")
    return emitted


def without_lowest(result: PackResult) -> PackResult:
    """``result`` with its lowest-scored packed memory moved to the excluded ones."""
    victim = min(result.packed, key=lambda m: (m.composite_score, m.memory_id))
    packed = tuple(m for m in result.packed if m is not victim)
    return replace(result, packed=packed, excluded=(*result.excluded, victim),
                   excluded_for_budget=result.excluded_for_budget + 1, budget_reached=True,
                   total_tokens=sum(m.tokens for m in packed), total_score=sum(m.composite_score for m in packed))
