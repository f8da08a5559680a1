"""The Anthropic Messages target: ``system`` blocks (the caller's, then the directive), the
compaction summary at the start of the first kept user turn and the memories block at the start
of the latest one (``pipeline.rendering.chat_render.anthropic_layout``),
with ``cache_control`` breakpoints on request, counted by ``pipeline.counting.chat_count``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..budget.catalog import ModelSpec
from ..conversation import context_edit
from ..conversation.history import HistoryFit
from ..conversation.layout import materialize
from ..counting import chat_count as cc
from ..counting.count import CountedSection, summary_counted
from ..counting.tokens import TokenCounter
from ..types import Turns
from .chat_render import add_breakpoints, anthropic_layout
from .render import Block, ChatOut, Emitted, Message, text_sections


@dataclass(frozen=True, slots=True)
class AnthropicRenderer:
    """``pipeline.rendering.render.Renderer`` for the Messages API."""

    turns: Turns
    model: str
    counter: TokenCounter
    costs: tuple[int, ...]
    fixed: int  # the caller's system and tools
    tools: int
    # Per message: its thinking blocks' tokens, and whether they count zero (an earlier turn's,
    # for a model the API strips them for: chat_count's module docstring).
    thinking: tuple[tuple[int, bool], ...] = ()

    @classmethod
    def create(cls, turns: Turns, spec: ModelSpec, counter: TokenCounter) -> AnthropicRenderer:
        model, system, messages = spec.name, turns.system, turns.messages
        latest = cc.latest_turn(messages) if cc.strips_prior_thinking(model) else None
        free = [latest is not None and i < latest for i in range(len(messages))]
        costs = tuple(cc.anthropic_message_tokens(m, counter, path=f"messages.{i}", free_thinking=free[i])
                      for i, m in enumerate(messages))
        thinking = tuple((cc.anthropic_thinking_tokens(m, counter), free[i]) for i, m in enumerate(messages))
        caller = list(system) if isinstance(system, list) else ([{"type": "text", "text": system}] if system else [])
        fixed = cc.anthropic_prompt_tokens(caller or None, [], turns.tools, counter, model=model)
        tools_n = cc.anthropic_tools_tokens(turns.tools, counter, model=model) if turns.tools else 0
        return cls(turns, model, counter, costs, fixed, tools_n, thinking)

    def recount(self, i: int, message: Message) -> int:
        """Message ``i`` as edited (context editing), by the rule its place gives its thinking."""
        free = bool(self.thinking) and self.thinking[i][1]
        return cc.anthropic_message_tokens(message, self.counter, path=f"messages.{i}", free_thinking=free)

    def _block(self, text: str) -> int:
        return cc.anthropic_prompt_tokens([{"type": "text", "text": text}], [], [], self.counter, model=self.model)

    def directive_tokens(self, directive: str | None, directive_text: CountedSection) -> int:
        return self._block(directive) if directive else 0

    def frame_tokens(self, directive_text: CountedSection) -> int:
        return self._block("")

    def summary_tokens(self, summary: str) -> int:
        """A user message of its own, the most it adds: as a block of the first kept user message
        it adds its text alone (a string content counts as its one text block)."""
        return cc.anthropic_prompt_tokens(None, [{"role": "user", "content": summary}], [], self.counter,
                                          model=self.model)

    def render(self, fit: HistoryFit, directive: str | None, directive_text: CountedSection, block: Block, *,
               breakpoints: bool, summary: str | None = None,
               clearing: context_edit.Clearing | None = None) -> Emitted:
        """Breakpoints are added after the stable parts when asked (``chat_render.add_breakpoints``)."""
        system, messages_in = self.turns.system, self.turns.messages
        layout = anthropic_layout(system, fit.kept, fit.kept_indices, directive=directive,
                                  memory_block=block.text or None, summary=summary)
        layout = replace(layout, wire=context_edit.apply(layout.wire, clearing, messages_in, "anthropic"))
        messages, blocks = materialize(layout.wire, messages_in, system)
        marked: list[str] = []
        if breakpoints:
            layout, marked = add_breakpoints(layout, blocks or [], messages, self.turns.tools)
            messages, blocks = materialize(layout.wire, messages_in, system)
        text = text_sections(directive_text, block, summary=summary_counted(self.counter, summary))
        return Emitted(text, ChatOut("anthropic", layout, messages, blocks, marked))

    def count(self, out: Emitted, counter: TokenCounter, *, block: Block | None = None) -> int:
        assert out.chat is not None
        return cc.anthropic_prompt_tokens(out.chat.system, out.chat.messages, self.turns.tools, counter,
                                          model=self.model)

    def stable_prefix(self, out: Emitted) -> int | None:
        """Tools, system, directive and the turns before the latest user turn (which holds the block),
        with the compaction summary when it opens that turn."""
        assert out.chat is not None
        messages, system, layout = out.chat.messages, out.chat.system, out.chat.layout
        tools: list[Any] = self.turns.tools
        if layout.memory_in_system and system:
            return cc.anthropic_prompt_tokens(system[:-1], [], tools, self.counter, model=self.model)
        at, before = layout.memory_message, messages[:layout.memory_message]
        if at is not None and layout.summary_message == at and layout.summary_block is not None:
            before = [*before, {"role": "user", "content": messages[at]["content"][:layout.summary_block + 1]}]
        return cc.anthropic_prompt_tokens(system, before, tools, self.counter, model=self.model)
