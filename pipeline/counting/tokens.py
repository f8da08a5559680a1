"""Token counting: exact for OpenAI encodings (offline ``bpe-openai``), a conservative estimate elsewhere.

Counts carry their tokenizer family and kind. Adding counts from different families or kinds
raises ``TokenizerMismatch``: the spec wants mixed assumptions to fail, not to be averaged.

The estimate (``estimate_tokens``) is an upper bound, on any text, of every exact encoding the
service ships (o200k_base, cl100k_base, llama3, qwen3; ``token_bound`` says why), times the
family's ``estimate_factor`` for the tokenizer the service cannot see.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import itertools
import math
import re
import sys
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from ...shared.wire.errors import TokenizerMismatch

EstimateKind = Literal["exact", "estimate"]  # a catalog family's own rule
# What produced a count (docs/assembly.md "Calibrated token counts").
CountKind = Literal["exact", "estimate", "calibrated"]


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

    def __hash__(self) -> int: ...  # by identity: per-counter memos (``pipeline.counting.count``) key on it


_ENCODINGS: dict[str, Any] = {}


# Encodings from quicktok-v1 (Llama 3, Qwen 2.5/3): adopted after its o200k and cl100k encoders
# matched bpe-openai token for token over the token corpus, the demo memories, this repository's
# text and 5,000 random multi-script strings (docs/assembly.md "Calibrated token counts"). OpenAI's
# encodings stay on bpe-openai.
QUICKTOK_ENCODINGS = frozenset({"llama3", "qwen3"})

MAX_CHARS_PER_CALL = 500_000  # bpe_openai refuses 1,000,000 characters in one call
MAX_TOKENS_PER_CALL = 200_000  # ... and more than 200,000 tokens (its chunk limit)
_BPE_BINDINGS = "bpe_openai._bindings"


def _bpe_openai_bindings() -> Any:
    """bpe-openai's native module, loaded without running the ``bpe_openai`` package's
    ``__init__`` where it can be: that parses every vocabulary the package ships (o200k, cl100k,
    voyage3) into Python tables, ~0.8 s of CPU in each process, which counting never reads (the
    native tokenizer builds its own in ~50 ms)."""
    loaded = sys.modules.get(_BPE_BINDINGS)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("bpe_openai")
    folders = package.submodule_search_locations if package is not None else None
    for folder in folders or []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder, f"_bindings{suffix}")
            spec = importlib.util.spec_from_file_location(_BPE_BINDINGS, path)
            if not path.is_file() or spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules[_BPE_BINDINGS] = module  # the package, when imported, uses this one
            spec.loader.exec_module(module)
            return module
    return importlib.import_module(_BPE_BINDINGS)  # another layout: through the package


class OpenAiBpe:
    """An OpenAI encoding on bpe-openai's native tokenizer, encoding as the package's
    ``Encoding.encode_ordinary`` does: lone surrogates replaced first (a UTF-16 round trip), and no
    more than ``max_tokens`` tokens in one call (``ExactCounter`` splits longer texts)."""

    max_tokens = MAX_TOKENS_PER_CALL

    def __init__(self, name: str) -> None:
        self._native = _bpe_openai_bindings().tokenizer_for_encoding(name)

    def encode_ordinary(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return list(self._native.encode(text)) if text else []


def _encoding(name: str) -> Any:
    """Load an offline BPE encoding once per process (vocabularies ship inside the wheels)."""
    enc = _ENCODINGS.get(name)
    if enc is None:
        if name in QUICKTOK_ENCODINGS:
            import quicktok

            enc = _ENCODINGS[name] = quicktok.get_encoding(name)
        else:
            enc = _ENCODINGS[name] = OpenAiBpe(name)
    return enc


class ExactCounter:
    """Exact counts with the model's own BPE encoding (o200k_base, cl100k_base; llama3, qwen3)."""

    kind: EstimateKind = "exact"

    def __init__(self, family: str, encoding: str) -> None:
        self.family = family
        self.encoding_name = encoding
        self._enc = _encoding(encoding)
        self._max_tokens: int | None = getattr(self._enc, "max_tokens", None)

    def count(self, text: str) -> int:
        if len(text) >= MAX_CHARS_PER_CALL:
            return self._count_long(text)
        try:
            n = len(self._enc.encode_ordinary(text))
        except (UnicodeEncodeError, ValueError, TypeError):
            # Lone surrogates cannot be encoded (quicktok refuses them with a TypeError); count them
            # as the replacement they will become. Any other refusal is re-raised.
            clean = text.encode("utf-8", "replace").decode("utf-8")
            if clean == text:
                raise
            return self.count(clean)
        if self._max_tokens is not None and n > self._max_tokens:
            return self._count_long(text)
        return n

    def _count_long(self, text: str) -> int:
        r"""The encoder refuses one call over 200,000 tokens or 1,000,000 characters (a 1M-token
        window holds more). Split
        where the pre-tokenizer always splits: before a space that follows a letter, digit or
        punctuation and precedes a letter (that space starts the next pre-token, `` ?\p{L}+``),
        so the halves' counts add up exactly. Text with no such place is charged its UTF-8 bytes,
        which no byte-level BPE count can exceed, or those of its NFC form when longer (Qwen
        normalizes first, and NFC can lengthen text: U+0958 becomes two characters)."""
        i = split_point(text)
        if i is None:
            return max(len(t.encode("utf-8", "surrogatepass")) for t in (text, unicodedata.normalize("NFC", text)))
        return self.count(text[:i]) + self.count(text[i:])


def split_point(text: str) -> int | None:
    """The index nearest the middle where the o200k/cl100k pre-tokenizers always split (a space
    after a non-space character and before a letter), or None."""
    mid = len(text) // 2
    for i in itertools.chain(range(mid, len(text) - 1), range(mid - 1, 0, -1)):
        if text[i] == " " and text[i + 1].isalpha() and not text[i - 1].isspace():
            return i
    return None


# --- The estimate: an upper bound of every shipped exact encoding ---------------------------------

# Non-ASCII characters of Unicode's general category N (Nd, Nl, No; Unicode 17, from the ``regex``
# module's tables, newer than Python's): with the ASCII digits, the numbers Qwen's pre-tokenizer
# takes one character at a time. Ranges of hex code points; tests/stack/test_estimate_bound.py checks
# the table against both sets of tables.
_NUMERAL_RANGES = (
    "B2-B3 B9 BC-BE 660-669 6F0-6F9 7C0-7C9 966-96F 9E6-9EF 9F4-9F9 A66-A6F AE6-AEF B66-B6F B72-B77 "
    "BE6-BF2 C66-C6F C78-C7E CE6-CEF D58-D5E D66-D78 DE6-DEF E50-E59 ED0-ED9 F20-F33 1040-1049 1090-1099 "
    "1369-137C 16EE-16F0 17E0-17E9 17F0-17F9 1810-1819 1946-194F 19D0-19DA 1A80-1A89 1A90-1A99 1B50-1B59 "
    "1BB0-1BB9 1C40-1C49 1C50-1C59 2070 2074-2079 2080-2089 2150-2182 2185-2189 2460-249B 24EA-24FF "
    "2776-2793 2CFD 3007 3021-3029 3038-303A 3192-3195 3220-3229 3248-324F 3251-325F 3280-3289 32B1-32BF "
    "A620-A629 A6E6-A6EF A830-A835 A8D0-A8D9 A900-A909 A9D0-A9D9 A9F0-A9F9 AA50-AA59 ABF0-ABF9 FF10-FF19 "
    "10107-10133 10140-10178 1018A-1018B 102E1-102FB 10320-10323 10341 1034A 103D1-103D5 104A0-104A9 "
    "10858-1085F 10879-1087F 108A7-108AF 108FB-108FF 10916-1091B 109BC-109BD 109C0-109CF 109D2-109FF "
    "10A40-10A48 10A7D-10A7E 10A9D-10A9F 10AEB-10AEF 10B58-10B5F 10B78-10B7F 10BA9-10BAF 10CFA-10CFF "
    "10D30-10D39 10D40-10D49 10E60-10E7E 10F1D-10F26 10F51-10F54 10FC5-10FCB 11052-1106F 110F0-110F9 "
    "11136-1113F 111D0-111D9 111E1-111F4 112F0-112F9 11450-11459 114D0-114D9 11650-11659 116C0-116C9 "
    "116D0-116E3 11730-1173B 118E0-118F2 11950-11959 11BF0-11BF9 11C50-11C6C 11D50-11D59 11DA0-11DA9 "
    "11DE0-11DE9 11F50-11F59 11FC0-11FD4 12400-1246F 12475-1247F 12550-12686 16130-16139 16A60-16A69 "
    "16AC0-16AC9 16B50-16B59 16B5B-16B61 16D70-16D79 16E80-16E96 16FF4-16FF6 1CCF0-1CCF9 1D2C0-1D2D3 "
    "1D2E0-1D2F3 1D360-1D378 1D7CE-1D7FF 1E140-1E149 1E2F0-1E2F9 1E4F0-1E4F9 1E5F1-1E5FA 1E8C7-1E8CF "
    "1E950-1E959 1EC71-1ECAB 1ECAD-1ECAF 1ECB1-1ECB4 1ED01-1ED2D 1ED2F-1ED3D 1F100-1F10C 1FBF0-1FBF9 "
)


def _numeral_class() -> re.Pattern[str]:
    spans = []
    for item in _NUMERAL_RANGES.split():
        lo, _, hi = item.partition("-")
        spans.append(chr(int(lo, 16)) + (f"-{chr(int(hi, 16))}" if hi else ""))
    return re.compile(f"[{''.join(spans)}]")


_NUMERAL = _numeral_class()  # one non-ASCII numeral
_DIGIT_RUN = re.compile(r"[0-9]+")


def numeral_surplus(text: str) -> int:
    """The most Qwen's one-character number pre-tokens can cost over cl100k's pre-tokens of up to
    three: for each run of numerals, its UTF-8 bytes (the most Qwen charges, a token per byte) minus
    one token per three characters (the least cl100k charges)."""
    if text.isascii():
        return sum(len(run) - (len(run) + 2) // 3 for run in _DIGIT_RUN.findall(text))
    # The table's class is slow to scan with: look for its characters among the distinct ones, and
    # scan the text for runs of the ASCII digits and those alone.
    found = _NUMERAL.findall("".join(set(text)))
    runs = re.compile(f"[0-9{''.join(sorted(found))}]+") if found else _DIGIT_RUN
    return sum(len(run.encode("utf-8")) - (len(run) + 2) // 3 for run in runs.findall(text))


@functools.cache
def _bound_counters() -> tuple[ExactCounter, ExactCounter]:
    return ExactCounter("o200k", "o200k_base"), ExactCounter("cl100k", "cl100k_base")


def token_bound(text: str) -> int:
    r"""An upper bound of the o200k_base, cl100k_base, llama3 and qwen3 counts of ``text``.

    o200k and cl100k are counted (``bpe-openai``, loaded wherever the service counts); the two
    quicktok encodings, which the client's fallback does not load, are bounded through cl100k:

    * llama3 pre-tokenizes like cl100k, and its first 100,256 tokens are cl100k's in the same rank
      order, every other token ranked after them. BPE merges the adjacent pair of lowest rank
      first, so on every pre-token llama3 makes each merge cl100k makes, in the same order, and
      then perhaps more: never more tokens than cl100k.
    * qwen3 normalizes to NFC, then pre-tokenizes like cl100k except that numbers (\p{N}) go one
      character at a time where cl100k takes up to three. Its vocabulary is cl100k's without the
      1,100 tokens of two or three digits, in the same rank order, its own tokens after them. Away
      from numbers the llama3 argument holds (no digit token can occur there); a run of numerals
      costs Qwen at most its UTF-8 bytes and cl100k at least a token per three characters. So
      qwen3(t) <= cl100k(NFC(t)) + numeral_surplus(NFC(t)).

    Over the encoders' per-call limits, ``ExactCounter`` splits where all four pre-tokenizers split
    or charges UTF-8 bytes, which no byte-level BPE count exceeds, so the bound holds there too.
    tests/stack/test_estimate_bound.py checks the vocabulary facts and the bound on generated text.
    """
    o200k, cl100k = _bound_counters()
    bound = max(o200k.count(text), cl100k.count(text) + numeral_surplus(text))
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        nfc = unicodedata.normalize("NFC", text)
        bound = max(bound, cl100k.count(nfc) + numeral_surplus(nfc))
    return bound


def _check_factor(factor: float) -> float:
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"an estimate factor must be a number >= 1 (below 1 the estimate would undercount), "
                         f"got {factor!r}")
    return factor


def estimate_tokens(text: str, *, factor: float = 1.0) -> int:
    """Conservative token count: ``token_bound`` times ``factor`` (>= 1, a family's margin for a
    tokenizer denser than the shipped ones), rounded up."""
    return math.ceil(token_bound(text) * _check_factor(factor))


class EstimateCounter:
    """Conservative estimate for families without an offline exact tokenizer."""

    kind: EstimateKind = "estimate"

    def __init__(self, family: str, factor: float = 1.0) -> None:
        self.family = family
        self.factor = _check_factor(factor)

    def count(self, text: str) -> int:
        return estimate_tokens(text, factor=self.factor)


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
    (org, model) (docs/assembly.md "Calibrated token counts"). Each count is rounded up, so a sum of counts
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
