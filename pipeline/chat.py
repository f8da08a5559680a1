"""Chat-native assembly: the proxy's conversation in, provider-ready messages out, never over the window.

A request with ``format`` ("openai" | "anthropic") carries the whole conversation in the provider's
own shape (README "Chat-native assembly"). The stages:

1. validate it strictly (``shared.chat``: paths in every error, tool calls paired with results);
2. count every fixed part the provider will see with the provider's own rules
   (``pipeline.chat_count``): tools, reply priming, the directive message, the memory block's frame;
3. fit the history into what is left (``pipeline.history``): oldest whole units first (an
   assistant tool call leaves with its results), system messages and the latest user turn never;
   if even those do not fit, ``ContextOverflow`` naming how many tokens over;
4. score and pack memories into what the kept history leaves, as for every request;
5. render the messages the proxy sends as is (``pipeline.chat_render``) and count that exact prompt.

The prompt's count is additive in its messages, so the packed memories can never push it over the
window; a final check on the emitted prompt repacks with less budget should a bound ever be wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ibex_context.pipeline import chat_count as cc
from ibex_context.pipeline import format as fmt
from ibex_context.pipeline.budget import compute_budget
from ibex_context.pipeline.chat_render import Layout, add_breakpoints, anthropic_layout, openai_layout
from ibex_context.pipeline.count import (
    CountedSection,
    LineCache,
    RequestSections,
    directive_counted,
    memory_cost,
    memory_overhead,
)
from ibex_context.pipeline.history import (
    HistoryFit,
    HistoryOverflow,
    HistoryPolicy,
    fit_history,
    history_budget,
)
from ibex_context.pipeline.types import ScoredMemory
from ibex_context.shared.calibration import Calibration
from ibex_context.shared.catalog import ModelSpec
from ibex_context.shared.chat import Conversation, parse_conversation, to_wire, wire_system, wire_tools
from ibex_context.shared.chat_layout import materialize
from ibex_context.shared.errors import ContextOverflow, InvalidRequest
from ibex_context.shared.models import AssembleRequest, BudgetBreakdown, HistoryDecision
from ibex_context.shared.tokens import TokenCount, TokenCounter

Message = dict[str, Any]
EMPTY = CountedSection("", 0)


@dataclass(frozen=True, slots=True)
class Prompt:
    """How one provider counts a prompt: per message, and the parts outside the messages."""

    format: str
    message: Callable[[Message], int]  # one conversation message, with its overhead
    fixed: int  # tools, reply priming, the caller's system (Anthropic): present whatever is kept
    tools: int
    directive: int  # the directive as the provider sees it (a message or a system block)
    memory_frame: int  # the memory block's own message or block, without its text
    role: str  # OpenAI: the role of the messages the service adds


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """The budget stage of a chat request: the validated conversation and what fits."""

    conversation: Conversation
    messages: list[Message]
    tools: list[Message]
    system: Any
    prompt: Prompt
    fit: HistoryFit
    budget: BudgetBreakdown


def _system_role(spec: ModelSpec) -> str:
    """o-series models take their instructions as ``developer`` messages (OpenAI API reference)."""
    name = spec.name
    return "developer" if len(name) > 1 and name[0] == "o" and name[1].isdigit() else "system"


def openai_prompt(spec: ModelSpec, counter: TokenCounter, tools: list[Message], directive: str | None) -> Prompt:
    role = _system_role(spec)

    def message(m: Message) -> int:
        return cc.openai_message_tokens(m, counter, model=spec.name)

    tools_n = cc.openai_tools_tokens(tools, counter, model=spec.name) if tools else 0
    fixed = cc.openai_prompt_tokens([], tools, counter, model=spec.name)  # priming + tools
    directive_n = message({"role": role, "content": directive}) if directive else 0
    return Prompt("openai", message, fixed, tools_n, directive_n, message({"role": role, "content": ""}), role)


def anthropic_prompt(spec: ModelSpec, counter: TokenCounter, system: Any, tools: list[Message],
                     directive: str | None) -> Prompt:
    def count(sys: Any, msgs: list[Message], tls: list[Message]) -> int:
        return cc.anthropic_prompt_tokens(sys, msgs, tls, counter, model=spec.name)

    base = count(None, [], [])
    caller_system = list(system) if isinstance(system, list) else ([{"type": "text", "text": system}] if system else [])

    def message(m: Message) -> int:
        return count(None, [m], []) - base

    def block(text: str) -> int:
        return count([{"type": "text", "text": text}], [], []) - base

    fixed = count(caller_system or None, [], tools)
    tools_n = cc.anthropic_tools_tokens(tools, counter, model=spec.name) if tools else 0
    return Prompt("anthropic", message, fixed, tools_n, block(directive) if directive else 0, block(""), "system")


def plan_chat(req: AssembleRequest, spec: ModelSpec, counter: TokenCounter, directive: str | None, *,
              nonce: str, reserve_fraction: float, constrained_below: int,
              calibration: Calibration | None = None) -> tuple[ChatPlan, int]:
    """Validate, count the fixed parts, fit the history; returns the plan and the memory text
    overhead (the block's frame, counted as in the flat text)."""
    assert req.format is not None
    conv = parse_conversation(req.format, list(req.messages), system=req.system, tools=list(req.tools) or None)
    messages, tools, system = to_wire(conv), wire_tools(conv) or [], wire_system(conv)
    prompt = (openai_prompt(spec, counter, tools, directive) if conv.format == "openai"
              else anthropic_prompt(spec, counter, system, tools, directive))
    mem_text = memory_overhead(counter, nonce)
    fam, kind = counter.family, counter.kind
    # Everything but the history, with an empty history: what the window has left for it.
    limits = (reserve_fraction, constrained_below, calibration)
    probe = _budget(spec, fam, kind, prompt, mem_text, 0, *limits)
    policy = HistoryPolicy(mode=req.history.mode, min_recent_turns=req.history.min_recent_turns,
                           min_memory_share=req.history.min_memory_share)
    try:
        fit = fit_history(conv.format, messages, cost=_indexed(prompt.message, messages),
                          budget=history_budget(max(0, probe.unclamped), policy), policy=policy)
    except HistoryOverflow as exc:
        over = exc.over_by + max(0, -probe.unclamped)
        raise ContextOverflow(
            f"messages: the conversation needs {exc.needed} tokens that cannot be dropped ({exc.reason}) but "
            f"{max(0, probe.unclamped)} are available for it in {spec.name}'s window: {over} tokens over",
            field="messages") from exc
    budget = _budget(spec, fam, kind, prompt, mem_text, fit.kept_tokens, *limits)
    return ChatPlan(conv, messages, tools, system, prompt, fit, budget), mem_text


def _indexed(cost: Callable[[Message], int], messages: list[Message]) -> Callable[[Message], int]:
    """``cost`` whose refusals name the message's place in the conversation (``messages.4.content.1``):
    the counters see one message at a time and name it ``message`` or ``messages.0``."""
    where = {id(m): i for i, m in enumerate(messages)}

    def counted(m: Message) -> int:
        try:
            return cost(m)
        except InvalidRequest as exc:
            field = exc.field or "message"
            head, _, rest = field.partition(".")
            if head == "messages":
                rest = rest.partition(".")[2]
            path = f"messages.{where.get(id(m), '?')}" + (f".{rest}" if rest else "")
            raise InvalidRequest(path + exc.message[len(field):], field=path) from exc

    return counted


def _budget(spec: ModelSpec, fam: str, kind: Any, prompt: Prompt, mem_text: int, history: int,
            reserve_fraction: float, constrained_below: int, calibration: Calibration | None) -> BudgetBreakdown:
    """The spec's subtraction in the provider's units: tools and the caller's system are fixed,
    the reply priming and the memory block's frame are the formatter's overhead."""
    return compute_budget(
        spec,
        directive=TokenCount(prompt.directive, fam, kind),
        messages=TokenCount(history + prompt.fixed - prompt.tools, fam, kind),
        tool_schemas=TokenCount(prompt.tools, fam, kind),
        formatter_overhead=TokenCount(prompt.memory_frame + mem_text, fam, kind),
        reserve_fraction=reserve_fraction,
        constrained_below=constrained_below,
        calibration=calibration,
    )


@dataclass(frozen=True, slots=True)
class ChatRender:
    """What the proxy sends the provider: the layout (what a reply carries), the messages and, for
    Anthropic, the system blocks it renders to here, and the ``cache_control`` breakpoints added."""

    layout: Layout
    messages: list[Message]
    system: list[Any] | None
    marked: list[str]


def render_chat(plan: ChatPlan, directive: str | None, memory_block: str | None, *,
                breakpoints: bool = False) -> ChatRender:
    """The provider-ready conversation, laid out over the caller's (``pipeline.chat_render``);
    breakpoints are added for Anthropic when asked."""
    kept, indices = plan.fit.kept, plan.fit.kept_indices
    if plan.conversation.format == "openai":
        layout = openai_layout(kept, indices, directive=directive, memory_block=memory_block,
                               system_role=plan.prompt.role)  # type: ignore[arg-type]
        return ChatRender(layout, materialize(layout.wire, plan.messages)[0], None, [])
    layout = anthropic_layout(plan.system, kept, indices, directive=directive, memory_block=memory_block)
    messages, system = materialize(layout.wire, plan.messages, plan.system)
    marked: list[str] = []
    if breakpoints:
        layout, marked = add_breakpoints(layout, system or [], messages, plan.tools)
        messages, system = materialize(layout.wire, plan.messages, plan.system)
    return ChatRender(layout, messages, system, marked)


def stable_prefix_tokens(plan: ChatPlan, spec: ModelSpec, counter: TokenCounter, out: ChatRender) -> int:
    """Tokens before the first part that depends on this turn's retrieval (the memory block):
    tools, system, directive and the conversation before it, counted by the provider's rules.

    The parts after it (the latest user turn, the reply priming) are not in it. Without a memory
    block everything but the priming is stable.
    """
    messages, system, at = out.messages, out.system, out.layout.memory_message
    if plan.conversation.format == "openai":
        before = messages if at is None else messages[:at]
        return cc.openai_prompt_tokens(before, plan.tools, counter, model=spec.name) - cc.REPLY_PRIMING
    if out.layout.memory_in_system and system:
        return cc.anthropic_prompt_tokens(system[:-1], [], plan.tools, counter, model=spec.name)
    return cc.anthropic_prompt_tokens(system, messages[:at], plan.tools, counter, model=spec.name)


def prompt_tokens(plan: ChatPlan, spec: ModelSpec, counter: TokenCounter, out: ChatRender, *,
                  block_tokens: int | None = None) -> int:
    """The count of exactly what is emitted, by the provider's rules. With ``block_tokens`` (the
    memories block's exact count, ``memory_block_tokens``) the OpenAI memory message is charged
    its frame plus that, instead of a fresh BPE pass over the block."""
    messages, at = out.messages, out.layout.memory_message
    if plan.conversation.format == "openai":
        if at is None or block_tokens is None:
            return cc.openai_prompt_tokens(messages, plan.tools, counter, model=spec.name)
        rest = [*messages[:at], *messages[at + 1:]]
        return cc.openai_prompt_tokens(rest, plan.tools, counter, model=spec.name) + plan.prompt.memory_frame + \
            block_tokens
    return cc.anthropic_prompt_tokens(out.system, messages, plan.tools, counter, model=spec.name)


def memory_block_tokens(counter: TokenCounter, kept: list[ScoredMemory], nonce: str,
                        lines: LineCache | None) -> int:
    """The exact tokens of the memories block, from counts already cached, for exact BPE families.

    Each line ends with ``>`` and a newline and the next starts with ``<``; the o200k and cl100k
    pre-tokenizers always split there (a punctuation run takes the trailing newlines and stops
    before ``<``), and BPE never merges across a split, so the block's count is the sum of its
    pieces. Only the frame, which carries this assembly's nonce, is counted afresh.
    """
    head, tail = fmt.memory_frame(nonce)
    return counter.count(head) + sum(memory_cost(counter, m.hit, lines) for m in kept) + counter.count(tail)


def history_decisions(fit: HistoryFit) -> list[HistoryDecision]:
    from ibex_context.pipeline.history import REASON_TEXT

    return [HistoryDecision(index=d.index, role=d.role, tokens=d.tokens,
                            reason=f"{d.reason}: {REASON_TEXT.get(d.reason, d.reason)}") for d in fit.dropped]


def directive_section(counter: TokenCounter, directive: str | None) -> CountedSection:
    """The directive as the flat ``rendered`` text shows it (for text-only readers of the response)."""
    return directive_counted(counter, directive)


def flat_sections() -> RequestSections:
    """A chat request has no flat history or tool sections: the conversation travels in ``messages``."""
    return RequestSections(EMPTY, EMPTY)
