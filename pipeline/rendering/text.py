"""The flat text target: the simple form's ``rendered`` text, sections ``## Directive``, the
compaction summary's block, ``## Recent conversation``, the memories block and ``## Tools``
(``pipeline.format`` renders them).

Counted line by line (``pipeline.counting.count.count_lines``): each history line is one message's cost,
so the history fit trims this form as it trims a provider's conversation, oldest units first.
Each line is charged with its newline and the last one the larger of with and without it (the
last message is always kept: it is pinned), so the kept lines' costs bound the section's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import format as fmt
from ..conversation.context_edit import Clearing
from ..conversation.history import HistoryFit
from ..counting.count import (
    CountedSection,
    joins_overhead,
    summary_counted,
    tools_counted,
)
from ..counting.tokens import TokenCounter
from ..types import Turns
from .render import Block, Emitted, text_sections


@dataclass(frozen=True, slots=True)
class TextRenderer:
    """``pipeline.rendering.render.Renderer`` for the flat text."""

    lines: tuple[str, ...]
    costs: tuple[int, ...]
    header: int  # the history header's tokens (0 without history)
    tools_section: CountedSection
    counter: TokenCounter
    thinking: tuple[tuple[int, bool], ...] = ()

    @property
    def fixed(self) -> int:
        return self.header + self.tools_section.tokens

    @property
    def tools(self) -> int:
        return self.tools_section.tokens

    @classmethod
    def create(cls, turns: Turns, counter: TokenCounter) -> TextRenderer:
        lines = [fmt.history_line(m["role"], m["content"]) for m in turns.messages]
        costs = [counter.count(line + "\n") for line in lines]
        if lines:
            costs[-1] = max(costs[-1], counter.count(lines[-1]))
        header = counter.count(fmt.HISTORY_HEADER) if lines else 0
        return cls(tuple(lines), tuple(costs), header, tools_counted(counter, turns.tools), counter)

    def recount(self, i: int, message: dict[str, Any]) -> int:
        """The flat form has no tool uses to clear: a message costs what it did."""
        return self.costs[i]

    def directive_tokens(self, directive: str | None, directive_text: CountedSection) -> int:
        return directive_text.tokens

    def frame_tokens(self, directive_text: CountedSection) -> int:
        """The joins between the sections outside the memories block (the one before the block
        is in ``count.memory_overhead``)."""
        history = CountedSection("x" if self.lines else "", 0)
        return joins_overhead(self.counter, (directive_text, history, self.tools_section))

    def summary_tokens(self, summary: str) -> int:
        """Its section and the join it adds."""
        return self.counter.count(summary) + self.counter.count(fmt.SECTION_JOIN)

    def render(self, fit: HistoryFit, directive: str | None, directive_text: CountedSection, block: Block, *,
               breakpoints: bool, summary: str | None = None, clearing: Clearing | None = None) -> Emitted:
        kept = [self.lines[i] for i in fit.kept_indices]
        history = CountedSection(fmt.join_section(fmt.HISTORY_HEADER, kept), self.header + fit.kept_tokens if kept
                                 else 0)
        return Emitted(text_sections(directive_text, block, history, self.tools_section,
                                     summary_counted(self.counter, summary)))

    def count(self, out: Emitted, counter: TokenCounter, *, block: Block | None = None) -> int:
        """The sections' counts and the joins between them: the bound the budget spent."""
        sections = out.text.sections
        return sum(s.tokens for s in sections) + counter.count(fmt.SECTION_JOIN) * max(0, len(sections) - 1)

    def stable_prefix(self, out: Emitted) -> int | None:
        return None
