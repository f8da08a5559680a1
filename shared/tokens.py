"""Token counting: exact for OpenAI encodings (offline ``bpe-openai``), a conservative estimate elsewhere.

Counts carry their tokenizer family and kind. Adding counts from different families or kinds
raises ``TokenizerMismatch``: the spec wants mixed assumptions to fail, not to be averaged.

The estimate is built to over-count: it charges each run of characters by its class (common
words, mixed identifiers, digits, punctuation, non-ASCII) at or above what the BPE encodings
charge in the worst case we measured (tests/test_tokens.py checks it on a varied corpus).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ibex_context.shared.errors import TokenizerMismatch

EstimateKind = Literal["exact", "estimate"]  # a catalog family's own rule
CountKind = Literal["exact", "estimate", "calibrated"]  # what produced a count (README "Calibrated token counts")


@dataclass(frozen=True, slots=True)
class TokenCount:
    n: int
    family: str
    kind: CountKind

    def __add__(self, other: TokenCount) -> TokenCount:
        if not isinstance(other, TokenCount):
            return NotImplemented
        if other.family != self.family or other.kind != self.kind:
            raise TokenizerMismatch(
                f"cannot combine {self.family}/{self.kind} tokens with {other.family}/{other.kind} tokens"
            )
        return TokenCount(self.n + other.n, self.family, self.kind)


class TokenCounter(Protocol):
    """What the pipeline counts with; the family and kind label every count it makes."""

    family: str

    @property
    def kind(self) -> CountKind: ...

    def count(self, text: str) -> int: ...


# Character classes, in the order the regex tries them.
_RUNS = re.compile(
    r"(?P<word>[A-Z]?[a-z]+)"  # ordinary word, optionally capitalised
    r"|(?P<alnum>[A-Za-z0-9]+)"  # identifiers, hex, CamelCase, mixed
    r"|(?P<space>[ \t]+)"
    r"|(?P<nl>[\r\n]+)"
    r"|(?P<punct>[\x21-\x2f\x3a-\x40\x5b-\x60\x7b-\x7e])"
    r"|(?P<ctrl>[\x00-\x08\x0b\x0c\x0e-\x1f\x7f])"
    r"|(?P<other>[^\x00-\x7f]+)"
)


def estimate_tokens(text: str, *, factor: float = 1.0) -> int:
    """Conservative token estimate; ``factor`` scales it for families with denser tokenizers."""
    total = 0.0
    for m in _RUNS.finditer(text):
        kind = m.lastgroup
        run = m.group()
        if kind == "word":  # common words are one token; long ones look like gibberish
            total += 1 if len(run) <= 6 else 2 if len(run) <= 12 else math.ceil(len(run) / 2.5)
        elif kind == "alnum":
            total += math.ceil(len(run) / 1.4)
        elif kind == "space":  # a single space merges into the next word
            total += 0 if len(run) == 1 else 1
        elif kind in ("nl", "punct", "ctrl"):
            total += 1
        else:  # non-ASCII run: measured worst case ~0.8 tokens per UTF-8 byte
            total += math.ceil(0.8 * len(run.encode("utf-8", "surrogatepass")))
    return math.ceil(total * factor)


class EstimateCounter:
    """Conservative estimate for families without an offline exact tokenizer."""

    kind: EstimateKind = "estimate"

    def __init__(self, family: str, factor: float = 1.0) -> None:
        self.family = family
        self.factor = factor

    def count(self, text: str) -> int:
        return estimate_tokens(text, factor=self.factor)


_ENCODINGS: dict[str, Any] = {}


# Encodings from quicktok-v1 (Llama 3, Qwen 2.5/3): adopted after its o200k and cl100k encoders
# matched bpe-openai token for token over the token corpus, the demo memories, this repository's
# text and 5,000 random multi-script strings (README "Calibrated token counts"). OpenAI's
# encodings stay on bpe-openai.
QUICKTOK_ENCODINGS = frozenset({"llama3", "qwen3"})


def _encoding(name: str) -> Any:
    """Load an offline BPE encoding once per process (vocabularies ship inside the wheel)."""
    enc = _ENCODINGS.get(name)
    if enc is None:
        if name in QUICKTOK_ENCODINGS:
            import quicktok

            enc = _ENCODINGS[name] = quicktok.get_encoding(name)
        else:
            import bpe_openai

            enc = _ENCODINGS[name] = bpe_openai.get_encoding(name)
    return enc


MAX_CHARS_PER_CALL = 500_000  # bpe_openai refuses 1,000,000 characters in one call


def bpe_limit_error() -> type[Exception]:
    """bpe_openai's error for an input over its per-call token limit."""
    import bpe_openai

    return bpe_openai.TokenLimitError  # type: ignore[no-any-return]


class ExactCounter:
    """Exact counts with the model's own BPE encoding (o200k_base, cl100k_base; llama3, qwen3)."""

    kind: EstimateKind = "exact"

    def __init__(self, family: str, encoding: str) -> None:
        self.family = family
        self.encoding_name = encoding
        self._enc = _encoding(encoding)

    def count(self, text: str) -> int:
        if len(text) >= MAX_CHARS_PER_CALL:
            return self._count_long(text)
        try:
            return len(self._enc.encode_ordinary(text))
        except bpe_limit_error():
            return self._count_long(text)
        except (UnicodeEncodeError, ValueError, TypeError):
            # Lone surrogates cannot be encoded (quicktok refuses them with a TypeError); count them
            # as the replacement they will become. Any other refusal is re-raised.
            clean = text.encode("utf-8", "replace").decode("utf-8")
            if clean == text:
                raise
            return self.count(clean)

    def _count_long(self, text: str) -> int:
        r"""The encoder refuses one call over 200,000 tokens or 1,000,000 characters (a 1M-token
        window holds more). Split
        where the pre-tokenizer always splits: before a space that follows a letter, digit or
        punctuation and precedes a letter (that space starts the next pre-token, `` ?\p{L}+``),
        so the halves' counts add up exactly. Text with no such place is charged its UTF-8 bytes,
        which no BPE count can exceed."""
        i = split_point(text)
        if i is None:
            return len(text.encode("utf-8"))
        return self.count(text[:i]) + self.count(text[i:])


def split_point(text: str) -> int | None:
    """The index nearest the middle where the o200k/cl100k pre-tokenizers always split (a space
    after a non-space character and before a letter), or None."""
    mid = len(text) // 2
    for i in itertools.chain(range(mid, len(text) - 1), range(mid - 1, 0, -1)):
        if text[i] == " " and text[i + 1].isalpha() and not text[i - 1].isspace():
            return i
    return None


class CachedCounter:
    """Per-worker LRU cache in front of a counter, keyed by a hash of the content.

    Memories repeat across requests for the same agent, so a warm cache turns counting into a
    hash and a dict lookup. Keys are 16-byte BLAKE2b digests so the cache never holds memory text.
    """

    def __init__(self, inner: TokenCounter, max_entries: int = 65536) -> None:
        self.inner = inner
        self.family = inner.family
        self.kind: CountKind = inner.kind
        self.max_entries = max_entries
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def count(self, text: str) -> int:
        if self.max_entries <= 0:
            return self.inner.count(text)
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        n = self._cache.get(key)
        if n is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return n
        self.misses += 1
        n = self.inner.count(text)
        self._cache[key] = n
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return n


class ScaledCounter:
    """A family's uncalibrated counter times the multiplier learned from usage reports for one
    (org, model) (README "Calibrated token counts"). Each count is rounded up, so a sum of counts
    still bounds the count of the joined text when the inner counter's does."""

    kind: CountKind = "calibrated"

    def __init__(self, inner: TokenCounter, multiplier: float) -> None:
        if not (math.isfinite(multiplier) and multiplier > 0):
            raise ValueError(f"a calibration multiplier must be a positive number, got {multiplier!r}")
        self.inner = inner
        self.family = inner.family
        self.multiplier = multiplier

    def scale(self, n: int) -> int:
        return math.ceil(n * self.multiplier)

    def count(self, text: str) -> int:
        return self.scale(self.inner.count(text))
