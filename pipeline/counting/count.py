"""Every token count of what the formatter renders (docs/assembly.md "Budget and token counting").

The budget subtracts the formatter's overhead *before* packing, so each piece is counted here in
the units the packer will spend:

* history and tool schemas are counted line by line (``count_lines``), so the per-worker count
  cache answers for every message already seen;
* ``memory_cost`` is the tokens of one rendered memory line including its wrapper and newline;
* ``memory_overhead`` is the frame of the memories section (safety sentence, nonce tags) plus the
  join before it.

The rendered memories section therefore costs at most sum(memory_cost) + memory_overhead
(``memory_tokens_bound``); ``fit_memory_section`` checks that with the real counter and drops the
lowest-scored memory in the rare case a tokenizer merges across a boundary. ``pipeline.format``
renders and never counts.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...shared.wire.models import Message
from .. import format as fmt
from ..types import MemoryHit, ScoredMemory
from .tokens import ScaledCounter, TokenCounter


@dataclass(frozen=True, slots=True)
class CountedSection:
    """A rendered section and an upper bound on its tokens (0 and "" when the section is empty)."""

    text: str
    tokens: int


def count_lines(counter: TokenCounter, header: str, lines: list[str]) -> CountedSection:
    """Section text and an upper bound on its tokens, counted line by line.

    Conversations grow by a message or two per call, so counting each line on its own lets the
    per-worker token cache (keyed by content hash) answer for every message already seen: the
    cost of counting history becomes the cost of the new messages. Each line is charged with its
    newline, so the sum bounds the count of the joined text (tests/unit/test_format.py checks this),
    except at the end: no newline follows the last line there, and a line ending in whitespace or
    punctuation can cost one token more without it (the newline merges into its last pre-token:
    "[user] |Tl|." is 6 o200k tokens, with "\n" 5). So the last line is charged the larger of
    both counts; a new message is tokenized twice while it is the last one.
    """
    if not lines:
        return CountedSection("", 0)
    *body, last = lines
    last_n = max(counter.count(last + "\n"), counter.count(last))
    n = counter.count(header) + sum(counter.count(line + "\n") for line in body) + last_n
    return CountedSection(fmt.join_section(header, lines), n)


def history_counted(counter: TokenCounter, messages: Sequence[Message]) -> CountedSection:
    return count_lines(counter, fmt.HISTORY_HEADER, fmt.history_lines(messages))


def tools_counted(counter: TokenCounter, schemas: Sequence[dict[str, Any]]) -> CountedSection:
    return count_lines(counter, fmt.TOOLS_HEADER, fmt.tool_lines(schemas))


def directive_counted(counter: TokenCounter, directive: str | None) -> CountedSection:
    text = fmt.directive_section(directive)
    return CountedSection(text, counter.count(text))


def summary_counted(counter: TokenCounter, summary: str | None) -> CountedSection:
    """The framed compaction summary as a flat section (empty without one)."""
    return CountedSection(summary, counter.count(summary)) if summary else CountedSection("", 0)


def joins_overhead(counter: TokenCounter, sections: Sequence[CountedSection]) -> int:
    """Tokens of the joins between the non-empty sections outside the memories block."""
    joins = sum(1 for s in sections if s.text)
    return counter.count(fmt.SECTION_JOIN) * max(0, joins - 1)


class LineCache:
    """Per-worker LRU of rendered memory lines, keyed by the exact (id, category, date, content).

    Escaping a long memory costs far more than hashing it, and the same memories come back for
    the same agent request after request. The key is the full text, so a hit can only ever return
    the rendering of that very memory: nothing crosses tenants. Each entry also keeps the line's
    token count per tokenizer family. The derived nonces of the memories blocks seen last are kept
    too, by their HMAC key and exact lines (the same memory set, the same block: hashing its lines
    again would cost more than the rest of the block's rendering): at most ``max_nonces`` blocks
    holding ``max_nonce_chars`` characters of lines between them, since a block's lines stay
    referenced after the line LRU has let them go.
    """

    def __init__(self, max_entries: int = 8192, max_nonces: int = 1024, max_nonce_chars: int = 16_000_000) -> None:
        self.max_entries = max_entries
        self.max_nonces = max_nonces
        self.max_nonce_chars = max_nonce_chars
        self._entries: OrderedDict[tuple[str, str, str | None, str], tuple[str, dict[str, int]]] = OrderedDict()
        self._nonces: OrderedDict[tuple[bytes, tuple[str, ...]], tuple[str, int]] = OrderedDict()  # nonce, chars
        self._nonce_chars = 0

    def _entry(self, h: MemoryHit) -> tuple[str, dict[str, int]]:
        key = (h.memory_id, h.category, h.date, h.content)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = (fmt.memory_line(h), {})
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def line(self, h: MemoryHit) -> str:
        """The memory's line. A line already cached keeps its place in the LRU: the pipeline asks
        for the lines of memories it priced (``cost``) moments before, in the same request."""
        entry = self._entries.get((h.memory_id, h.category, h.date, h.content))
        return entry[0] if entry is not None else self._entry(h)[0]

    def nonce(self, key: bytes, lines: Sequence[str]) -> str:
        """``format.derive_nonce(key, lines)``, kept for the blocks seen last."""
        cache_key = (key, tuple(lines))
        kept = self._nonces.get(cache_key)
        if kept is not None:
            self._nonces.move_to_end(cache_key)
            return kept[0]
        nonce = fmt.derive_nonce(key, lines)
        chars = sum(map(len, lines))
        if chars <= self.max_nonce_chars:
            self._nonces[cache_key] = (nonce, chars)
            self._nonce_chars += chars
            while len(self._nonces) > self.max_nonces or self._nonce_chars > self.max_nonce_chars:
                self._nonce_chars -= self._nonces.popitem(last=False)[1][1]
        return nonce

    def cost(self, h: MemoryHit, counter: TokenCounter) -> int:
        """The line's token count for this counter's family, counted once per family (a calibrated
        counter scales its family's cached count: the cache never holds a per-org figure)."""
        if isinstance(counter, ScaledCounter):
            return counter.scale(self.cost(h, counter.inner))
        line, costs = self._entry(h)
        n = costs.get(counter.family)
        if n is None:
            n = costs[counter.family] = counter.count(line)
        return n


def memory_cost(counter: TokenCounter, hit: MemoryHit, lines: LineCache | None = None) -> int:
    """Tokens one packed memory adds to the rendered section (wrapper and newline included)."""
    return lines.cost(hit, counter) if lines is not None else counter.count(fmt.memory_line(hit))


@dataclass(frozen=True, slots=True)
class MemoryCost:
    """``memory_cost`` bound to one request's counter and the worker's line cache: the scorer's
    cost function."""

    counter: TokenCounter
    lines: LineCache | None = None

    def __call__(self, hit: MemoryHit) -> int:
        lines = self.lines  # memory_cost, one call fewer: the scorer asks once per candidate
        return lines.cost(hit, self.counter) if lines is not None else self.counter.count(fmt.memory_line(hit))


def memory_overhead(counter: TokenCounter, nonce: str) -> int:
    """Fixed cost of the memories section: the join before it, the safety sentence and the frame.

    An upper bound that does not depend on the nonce's value (so it is cached per family): the
    frame's constant pieces are counted separately and each nonce occurrence is charged one token
    per character, the most a hex string can cost.
    """
    constant, occurrences = _memory_frame_cost(counter)
    return constant + occurrences * len(nonce)


@functools.lru_cache(maxsize=256)
def _memory_frame_cost(counter: TokenCounter) -> tuple[int, int]:
    """(tokens of the frame's constant pieces, how many times the nonce occurs in it), per counter."""
    head, tail = fmt.memory_frame("\x00")
    pieces = [fmt.SECTION_JOIN, *head.split("\x00"), *tail.split("\x00")]
    return sum(counter.count(p) for p in pieces if p), head.count("\x00") + tail.count("\x00")


def memory_tokens_bound(counter: TokenCounter, packed_tokens: int, overhead: int) -> int:
    """The memories section's tokens by the additive bound (its join is counted with the others)."""
    return packed_tokens + overhead - counter.count(fmt.SECTION_JOIN)


@dataclass(frozen=True, slots=True)
class FittedMemories:
    """The rendered memories section, its exact tokens, the memories in it and those dropped to
    make it fit."""

    text: str
    tokens: int
    kept: list[ScoredMemory]
    dropped: list[ScoredMemory]


def fit_memory_section(
    counter: TokenCounter, memories: Sequence[ScoredMemory], nonce: str, limit: int
) -> FittedMemories:
    """Render the memories section and guarantee its real count stays within ``limit``.

    ``limit`` is sum(memory costs) + overhead as budgeted. Drops lowest-scored memories only if
    the real tokenizer disagrees with the additive estimate.
    """
    kept = list(memories)
    dropped: list[ScoredMemory] = []
    while kept:
        text = fmt.memory_section(kept, nonce)
        n = counter.count(text)
        if counter.count(fmt.SECTION_JOIN) + n <= limit:
            return FittedMemories(text, n, kept, dropped)
        victim = min(kept, key=lambda m: (m.composite_score, m.memory_id))
        kept.remove(victim)
        dropped.append(victim)
    return FittedMemories("", 0, kept, dropped)
