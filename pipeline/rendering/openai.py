"""The OpenAI Chat Completions target: the caller's messages with the directive, the compaction
summary and the memories block as system (``developer`` for o-series) messages
(``pipeline.rendering.chat_render.openai_layout``), counted by the cookbook's rules
(``pipeline.counting.chat_count``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import format as fmt
from ..budget.catalog import ModelSpec
from ..conversation import context_edit
from ..conversation.history import HistoryFit
from ..conversation.layout import materialize
from ..counting import chat_count as cc
from ..counting.count import CountedSection, LineCache, memory_cost, summary_counted
from ..counting.tokens import TokenCounter
from ..types import ScoredMemory, Turns
from .chat_render import SystemRole, openai_layout
from .render import Block, ChatOut, Emitted, Message, text_sections


def system_role(spec: ModelSpec) -> SystemRole:
    """o-series models take their instructions as ``developer`` messages (OpenAI API reference)."""
    name = spec.name
    return "developer" if len(name) > 1 and name[0] == "o" and name[1].isdigit() else "system"


@dataclass(frozen=True, slots=True)
class OpenAIRenderer:
    """``pipeline.rendering.render.Renderer`` for Chat Completions."""

    turns: Turns
    model: str
    counter: TokenCounter
    role: SystemRole
    costs: tuple[int, ...]
    fixed: int  # reply priming and tools
    tools: int
    frame: int  # the memories block's own message, without its text
    thinking: tuple[tuple[int, bool], ...] = ()  # Chat Completions carries no reasoning to count

    @classmethod
    def create(cls, turns: Turns, spec: ModelSpec, counter: TokenCounter) -> OpenAIRenderer:
        model, role = spec.name, system_role(spec)
        costs = tuple(cc.openai_message_tokens(m, counter, model=model, path=f"messages.{i}")
                      for i, m in enumerate(turns.messages))
        tools_n = cc.openai_tools_tokens(turns.tools, counter, model=model) if turns.tools else 0
        fixed = cc.openai_prompt_tokens([], turns.tools, counter, model=model)
        frame = cc.openai_message_tokens({"role": role, "content": ""}, counter, model=model)
        return cls(turns, model, counter, role, costs, fixed, tools_n, frame)

    def recount(self, i: int, message: Message) -> int:
        """Message ``i`` as edited (context editing)."""
        return cc.openai_message_tokens(message, self.counter, model=self.model, path=f"messages.{i}")

    def directive_tokens(self, directive: str | None, directive_text: CountedSection) -> int:
        if not directive:
            return 0
        return cc.openai_message_tokens({"role": self.role, "content": directive}, self.counter, model=self.model)

    def frame_tokens(self, directive_text: CountedSection) -> int:
        return self.frame

    def summary_tokens(self, summary: str) -> int:
        """Its own message, exact: the cookbook's count is additive in messages."""
        return cc.openai_message_tokens({"role": self.role, "content": summary}, self.counter, model=self.model)

    def render(self, fit: HistoryFit, directive: str | None, directive_text: CountedSection, block: Block, *,
               breakpoints: bool, summary: str | None = None,
               clearing: context_edit.Clearing | None = None) -> Emitted:
        layout = openai_layout(fit.kept, fit.kept_indices, directive=directive, memory_block=block.text or None,
                               system_role=self.role, summary=summary)
        layout = replace(layout, wire=context_edit.apply(layout.wire, clearing, self.turns.messages, "openai"))
        messages = materialize(layout.wire, self.turns.messages)[0]
        text = text_sections(directive_text, block, summary=summary_counted(self.counter, summary))
        return Emitted(text, ChatOut("openai", layout, messages, None, []))

    def count(self, out: Emitted, counter: TokenCounter, *, block: Block | None = None) -> int:
        """With an exact ``counter`` and the ``block`` it priced, the memories message is charged its
        frame plus the block's exact count (``scored_block_tokens``), instead of a fresh BPE pass."""
        assert out.chat is not None
        messages, at, tools = out.chat.messages, out.chat.layout.memory_message, self.turns.tools
        if at is None or block is None or not block.text or counter.kind != "exact":
            return cc.openai_prompt_tokens(messages, tools, counter, model=self.model)
        rest = [*messages[:at], *messages[at + 1:]]
        exact = scored_block_tokens(counter, block.kept, block.nonce)
        return cc.openai_prompt_tokens(rest, tools, counter, model=self.model) + self.frame + exact

    def stable_prefix(self, out: Emitted) -> int | None:
        """Tools, system, directive and the conversation before the memories message, without
        the reply priming (it comes after the latest user turn)."""
        assert out.chat is not None
        messages, at = out.chat.messages, out.chat.layout.memory_message
        before = messages if at is None else messages[:at]
        return cc.openai_prompt_tokens(before, self.turns.tools, self.counter, model=self.model) - cc.REPLY_PRIMING


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


def scored_block_tokens(counter: TokenCounter, kept: list[ScoredMemory], nonce: str) -> int:
    """``memory_block_tokens`` for memories the scorer priced with this ``counter``: each one's
    ``tokens`` already is its line's count (``count.MemoryCost``), so no line is looked up again."""
    head, tail = fmt.memory_frame(nonce)
    return counter.count(head) + sum(m.tokens for m in kept) + counter.count(tail)
