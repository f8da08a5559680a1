"""What a renderer is: one target's way of counting and laying out a prompt (one per provider).

Every request, whatever form it came in, reaches the pipeline as one ``Turns`` (``pipeline.rendering.turns``)
and is rendered by one ``Renderer``: ``render_openai`` and ``render_anthropic`` emit the
provider-ready conversation, ``render_text`` the flat ``rendered`` text of the simple form. A new
provider is a new renderer; the stages before it (fit, budget, score, pack) never look at the form.

Every render also carries the flat text of the directive and memories block (``text_sections``),
so a text-only reader of any response sees the same sections.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...shared.wire.models import ChatFormat, SectionName
from .. import format as fmt
from ..conversation.context_edit import Clearing
from ..conversation.fit import TargetCosts
from ..conversation.history import HistoryFit
from ..counting.count import CountedSection
from ..counting.tokens import TokenCounter
from ..types import ScoredMemory
from .chat_render import Layout

Message = dict[str, Any]
EMPTY = CountedSection("", 0)


@dataclass(frozen=True, slots=True)
class Block:
    """The memories block of one render: its text ("" when nothing is packed), its tokens as the
    flat text charges them, its nonce, the memories in it and those dropped to make it fit."""

    text: str
    tokens: int
    nonce: str
    kept: list[ScoredMemory]
    dropped: list[ScoredMemory]


@dataclass(frozen=True, slots=True)
class ChatOut:
    """What the proxy sends a provider: the layout (what a reply carries), the messages and, for
    Anthropic, the system blocks it renders to, and the ``cache_control`` breakpoints added."""

    format: ChatFormat
    layout: Layout
    messages: list[Message]
    system: list[Any] | None
    marked: list[str]


@dataclass(frozen=True, slots=True)
class Emitted:
    """One render: the flat text and its sections, and the conversation when the target has one."""

    text: fmt.Rendered
    chat: ChatOut | None = None


class Renderer(TargetCosts, Protocol):
    """One target's rules. Built per request from its ``Turns`` (before retrieval: it needs the
    request alone); what the fit stage reads of it is ``TargetCosts``."""

    @property
    def thinking(self) -> tuple[tuple[int, bool], ...]:
        """Per message, its thinking tokens and whether they count zero (Anthropic; else empty)."""
        ...

    def render(self, fit: HistoryFit, directive: str | None, directive_text: CountedSection, block: Block, *,
               breakpoints: bool, summary: str | None = None, clearing: Clearing | None = None) -> Emitted:
        """The kept history with the directive, the framed compaction summary and the memories block
        placed, and the tool uses ``clearing`` cleared."""
        ...

    def count(self, out: Emitted, counter: TokenCounter, *, block: Block | None = None) -> int:
        """Tokens of exactly what ``out`` emits, by ``counter`` and the target's rules (``block``:
        the memories block as rendered, whose memories were priced with ``counter``)."""
        ...

    def stable_prefix(self, out: Emitted) -> int | None:
        """Tokens before the first part that depends on this turn's retrieval (None: no conversation)."""
        ...


def text_sections(directive: CountedSection, block: Block, history: CountedSection = EMPTY,
                  tools: CountedSection = EMPTY, summary: CountedSection = EMPTY) -> fmt.Rendered:
    """The flat text: the non-empty sections in their fixed order."""
    parts: Sequence[tuple[SectionName, str, int]] = [("directive", directive.text, directive.tokens),
                                              ("summary", summary.text, summary.tokens),
                                              ("history", history.text, history.tokens),
                                              ("memories", block.text, block.tokens),
                                              ("tools", tools.text, tools.tokens)]
    return fmt.assemble_text(parts)
