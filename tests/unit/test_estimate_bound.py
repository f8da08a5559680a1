"""The token estimate is an upper bound on every exact encoder the service ships.

Families without a shipped vocabulary (Claude, Gemini, Mistral; Llama 3 and Qwen in the client's
fallback) are budgeted with ``estimate_tokens``; the service promises never to go over the window,
so on any text the estimate must be at least what o200k_base, cl100k_base, llama3 and qwen3 count.
The property tests generate adversarial text (whitespace and control runs, punctuation chains,
numbers in every script, emoji, CJK, base64, text that NFC changes, random Unicode) and natural
text; the hand cases pin texts that cost far more tokens than their words suggest; the structure
tests check the vocabulary facts the bound's argument rests on (``pipeline.counting.tokens.token_bound``);
the pipeline and stack tests send Claude, Gemini and Mistral requests whose history or memories
are mostly whitespace, offline and through the real broker and worker.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_estimate_bound.py.
"""

from __future__ import annotations

import base64
import json
import random
import string
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.counting.tokens import ExactCounter, estimate_tokens
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse
from tests.properties import examples

ROOT = Path(__file__).resolve().parents[2]
CATALOG = Catalog.load()
EXACT = [ExactCounter("o200k", "o200k_base"), ExactCounter("cl100k", "cl100k_base"),
         ExactCounter("llama3", "llama3"), ExactCounter("qwen", "qwen3")]
ESTIMATED = sorted(name for name, fam in CATALOG.families.items() if fam.estimate_kind == "estimate")
FALLBACK = Catalog.load(slow_vocabularies=False)  # the client library's fallback: llama3 and qwen estimated


def max_exact(text: str) -> int:
    return max(e.count(text) for e in EXACT)


def assert_bound(text: str) -> None:
    """The raw estimate and every estimated family's counter (with its factor) bound every encoder."""
    most = max_exact(text)
    assert estimate_tokens(text) >= most, (repr(text[:80]), estimate_tokens(text), most)
    for family in ESTIMATED:
        assert CATALOG.counter(family).inner.count(text) >= most, family
    for family in ("llama3", "qwen"):
        assert FALLBACK.counter(family).inner.count(text) >= most, family


def _natural() -> list[str]:
    texts = []
    for line in (ROOT / "memory" / "data" / "demo.jsonl").read_text("utf-8").splitlines():
        row = json.loads(line)
        texts.append(row.get("content") or row.get("text") or "")
    for line in (ROOT / "bench" / "data" / "conversations.jsonl").read_text("utf-8").splitlines():
        texts.append(json.loads(line)["content"])
    return [t for t in texts if t]


NATURAL = _natural()
WORDS = sorted({w for t in NATURAL for w in t.split()})

# ---------------------------------------------------------------------------------- hand cases

_rng = random.Random(2026)
_SHORT_WORDS = [w for w in WORDS if w.isalpha() and 4 <= len(w) <= 6]
DOTTED = ".".join(_rng.choice(_SHORT_WORDS) for _ in range(3000))
HAND_CASES = {
    "space-tab": " \t" * 5000,
    "crlf": "\r\n" * 5000,
    "spaces": " " * 5000,
    "tabs": "\t" * 5000,
    "newlines": "\n" * 5000,
    "vt-ff": "\x0b\x0c" * 3000,
    "nbsp-ideographic-space": "\u00a0\u3000 " * 2000,
    "controls": "".join(chr(_rng.randrange(32)) for _ in range(5000)),
    "dotted-short-words": DOTTED,
    "dotted-random-words": ".".join("".join(_rng.choice(string.ascii_lowercase) for _ in range(_rng.randint(4, 6)))
                                    for _ in range(2000)),
    "dotted-capitalised": ".".join("".join(_rng.choice(string.ascii_lowercase) for _ in range(_rng.randint(4, 6)))
                                   .capitalize() for _ in range(2000)),
    "hyphen-chains": "-".join(_rng.choice(WORDS) for _ in range(2000)),
    "punctuation": "".join(_rng.choice(string.punctuation) for _ in range(5000)),
    "punct-pairs": "!?" * 2500,
    "digits": "".join(_rng.choice(string.digits) for _ in range(5000)),
    "digits-spaced": " ".join(str(_rng.randrange(10**6)) for _ in range(1000)),
    "fullwidth-digits": "".join(chr(0xFF10 + _rng.randrange(10)) for _ in range(3000)),
    "superscripts-fractions": "²³¹¼½¾" * 500,
    "random-lowercase": "".join(_rng.choice(string.ascii_lowercase) for _ in range(5000)),
    "random-letters": "".join(_rng.choice(string.ascii_letters) for _ in range(5000)),
    "hex": "".join(_rng.choice("0123456789abcdef") for _ in range(5000)),
    "base64": base64.b64encode(_rng.randbytes(4000)).decode(),
    "url": "https://example.com/a/b?" + "&".join(f"k{i}={_rng.randrange(10**9)}" for i in range(300)),
    "emoji": "😀🎉👍🏽👨‍👩‍👧‍👦🏳️‍🌈" * 300,
    "cjk": "日本語の文章を書きます。中文测试。한국어 문장" * 200,
    "devanagari-nukta": "\u0958" * 500 + "क़" * 500,  # NFC decomposes U+0958, Qwen normalizes
    "combining": "e\u0301\u0344a\u0308" * 500,
    "mixed-scripts": "Ωмир١٢٣ שלום 日本 🎉 abc123 ..." * 200,
    "code": (ROOT / "pipeline" / "counting" / "tokens.py").read_text("utf-8"),
    "readme": (ROOT / "README.md").read_text("utf-8"),
}


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_estimate_bounds_every_exact_encoder_on_hand_cases(name: str) -> None:
    assert_bound(HAND_CASES[name])


def test_whitespace_runs_are_not_one_token() -> None:
    assert estimate_tokens(" \t" * 5000) >= 4999
    assert estimate_tokens("\r\n" * 5000) >= 1250
    assert CATALOG.counter("claude").count(" \t" * 5000) >= 5000


def test_estimate_stays_tight_on_natural_text() -> None:
    """On the demo memories and the conversation turns the estimate is within 2 % of the largest
    exact count (the family's ``estimate_factor`` is the margin for the unknown tokenizer)."""
    est = sum(estimate_tokens(t) for t in NATURAL)
    most = sum(max_exact(t) for t in NATURAL)
    assert most <= est <= 1.02 * most


def test_an_estimate_factor_below_one_is_refused() -> None:
    from ibex_context.pipeline.counting.tokens import EstimateCounter

    with pytest.raises(ValueError, match="factor"):
        EstimateCounter("claude", 0.9)
    with pytest.raises(ValueError, match="factor"):
        EstimateCounter("claude", float("nan"))


# ---------------------------------------------------------------------------------- properties

WHITESPACE = st.text(alphabet=" \t\r\n\x0b\x0c\x85\u00a0\u1680\u2000\u2028\u2029\u202f\u3000", min_size=1,
                     max_size=400)
CONTROLS = st.text(alphabet=st.characters(categories=["Cc", "Cf"]), min_size=1, max_size=200)
PUNCT = st.text(alphabet=string.punctuation + "«»“”‘’—–…·•§¶†‡", min_size=1, max_size=200)
NUMERALS = st.text(alphabet=st.characters(categories=["Nd", "Nl", "No"]), min_size=1, max_size=60)
ASCII_DIGITS = st.text(alphabet=string.digits + " .,", min_size=1, max_size=200)
EMOJI = st.lists(st.sampled_from(["😀", "🎉", "👍", "🏽", "\u200d", "👨", "👩", "👧", "🏳", "\ufe0f", "🌈", "🇫",
                                  "🇷", "❤", "🔥", "🤖"]), min_size=1, max_size=60).map("".join)
CJK = st.text(alphabet=st.characters(min_codepoint=0x3040, max_codepoint=0x9FFF), min_size=1, max_size=120)
HANGUL_JAMO = st.text(alphabet=st.characters(min_codepoint=0x1100, max_codepoint=0x11FF), min_size=1, max_size=60)
COMBINING = st.text(alphabet=st.characters(categories=["Mn", "Mc"]), min_size=1, max_size=30)
DECOMPOSABLE = st.text(alphabet=st.sampled_from([c for c in map(chr, range(0x80, 0x3000))
                                                 if unicodedata.normalize("NFC", c) != c]), min_size=1, max_size=40)
BASE64 = st.binary(min_size=1, max_size=600).map(lambda b: base64.b64encode(b).decode())
LETTERS = st.text(alphabet=string.ascii_letters, min_size=1, max_size=200)
NATURAL_WORDS = st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).flatmap(
    lambda ws: st.sampled_from([" ", ".", "-", "", "\n", "_", "/"]).map(lambda sep: sep.join(ws)))
ANY = st.text(max_size=200)
PIECE = st.one_of(WHITESPACE, CONTROLS, PUNCT, NUMERALS, ASCII_DIGITS, EMOJI, CJK, HANGUL_JAMO, COMBINING,
                  DECOMPOSABLE, BASE64, LETTERS, NATURAL_WORDS, ANY)


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(PIECE, min_size=1, max_size=12).map("".join))
def test_property_estimate_bounds_adversarial_text(text: str) -> None:
    assert_bound(text)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.sampled_from(NATURAL), min_size=1, max_size=8),
       st.sampled_from(["\n", " ", "\n\n", "", "\t"]))
def test_property_estimate_bounds_natural_text(texts: list[str], sep: str) -> None:
    assert_bound(sep.join(texts))


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from([" ", "\t", " \t", "\r\n", "\n", "\n ", "\u3000", ".", "1", "a1", "🎉", "\x00"]),
       st.integers(1, 40_000))
def test_property_long_repeated_runs(unit: str, times: int) -> None:
    assert_bound(unit * times)


@pytest.mark.parametrize("text", [" \t" * 300_000, "\u0344" * 600_000, "word. " * 100_000 + "1" * 200_000],
                         ids=["whitespace", "nfc-lengthens", "prose-and-digits"])
def test_over_the_per_call_limit(text: str) -> None:
    """Over ``MAX_CHARS_PER_CALL`` counters split where every pre-tokenizer splits or charge UTF-8
    bytes; the bytes must be those of the NFC form when it is longer (U+0344 becomes two marks,
    which Qwen charges three tokens where the raw text has two bytes)."""
    import quicktok

    from ibex_context.pipeline.counting.tokens import MAX_CHARS_PER_CALL

    assert len(text) >= MAX_CHARS_PER_CALL
    whole = {e.encoding_name: len(quicktok.get_encoding(e.encoding_name).encode_ordinary(text)) for e in EXACT[2:]}
    assert all(e.count(text) >= whole[e.encoding_name] for e in EXACT[2:])  # one call, no split: the truth
    assert estimate_tokens(text) >= max(max_exact(text), *whole.values())


# -------------------------------------------------------- the vocabulary facts behind the bound

def test_llama3_extends_cl100k_rank_for_rank() -> None:
    """Llama 3's first 100,256 tokens are cl100k_base's, in rank order, every other token after
    them: its BPE makes every merge cl100k makes, and perhaps more, so it never counts more."""
    import quicktok

    cl100k, llama3 = quicktok.get_encoding("cl100k_base"), quicktok.get_encoding("llama3")
    assert all(cl100k.decode_single_token_bytes(i) == llama3.decode_single_token_bytes(i) for i in range(100_256))


def test_qwen3_is_cl100k_without_multi_digit_tokens_in_rank_order() -> None:
    import quicktok

    cl100k, qwen3 = quicktok.get_encoding("cl100k_base"), quicktok.get_encoding("qwen3")
    cl = [cl100k.decode_single_token_bytes(i) for i in range(100_256)]
    kept = [b for b in cl if not (len(b) > 1 and b.isdigit())]
    assert len(cl) - len(kept) == 1100  # 00-99 and 000-999 as strings of two or three digits
    assert [qwen3.decode_single_token_bytes(i) for i in range(len(kept))] == kept


def test_numeral_table_covers_every_unicode_number() -> None:
    """The numeral runs the bound charges for Qwen's one-digit pre-tokens include every \\p{N}
    character, by Python's tables and by the newer ones of the ``regex`` module."""
    import regex  # type: ignore[import-untyped]

    from ibex_context.pipeline.counting.tokens import numeral_surplus

    every = "".join(map(chr, [*range(0xD800), *range(0xE000, 0x110000)]))
    numbers = set(regex.findall(r"\p{N}", every)) | {c for c in every if unicodedata.category(c)[0] == "N"}
    assert len(numbers) > 2000
    assert all(numeral_surplus(c * 2) == len((c * 2).encode()) - 1 for c in numbers)
    assert numeral_surplus("".join(sorted(numbers))) == len("".join(sorted(numbers)).encode()) - (len(numbers) + 2) // 3
    assert numeral_surplus("abc ½ 日本") == len("½".encode()) - 1 and numeral_surplus("12 345") == 1 + 2


# ----------------------------------------------------------------------- through the pipeline

WHITE_TURN = " \t" * 50_000  # 100,000 characters, 50,000 o200k tokens


def _limit(resp: AssembleResponse) -> int:
    return resp.budget.context_window - resp.budget.response_reserve


def _whitespace_history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i}" + WHITE_TURN})
        msgs.append({"role": "assistant", "content": f"answer {i}" + WHITE_TURN})
    msgs.append({"role": "user", "content": "What was the invoice amount?"})
    return msgs


def _o200k_prompt(resp: AssembleResponse, model: str, fmt: str) -> int:
    counter = CATALOG.counter("o200k")
    assert resp.messages is not None
    if fmt == "anthropic":
        return cc.anthropic_prompt_tokens(resp.system, resp.messages, [], counter, model=model)
    return cc.openai_prompt_tokens(resp.messages, [], counter, model=model)


@pytest.mark.parametrize(("model", "fmt"), [("claude-sonnet-4", "anthropic"), ("claude-sonnet-4", "openai"),
                                            ("gemini-2.0-flash", "openai")])
def test_whitespace_history_is_trimmed_by_its_real_size(model: str, fmt: str) -> None:
    msgs = _whitespace_history(3)  # ~300K o200k tokens against a 200K window (gemini: 1M, fits)
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model=model, query="invoice",
                          format=fmt, messages=msgs, deadline_ns=1)  # type: ignore[arg-type]
    resp = assemble(req, offline_result(directive="Be brief.", hot=[], cold=[]), Engine(CATALOG, Policy()))
    exact = _o200k_prompt(resp, model, fmt)
    assert resp.prompt_tokens is not None and resp.prompt_tokens >= exact and exact <= _limit(resp)
    assert (len(resp.history) > 0) == (CATALOG.model(model).context_window < 300_000)


def test_whitespace_memory_is_charged_its_real_size() -> None:
    """A memory that is one long whitespace run costs what it really costs: the packer drops it
    from a 32K window rather than charging it a few hundred tokens."""
    hits = [MemoryHit(f"w{i}", f"note {i}" + " \t" * 30_000, "fact", 0.9, 0.9, i + 1, "hot") for i in range(2)]
    hits.append(MemoryHit("small", "the invoice was 42 euros", "fact", 0.5, 0.9, 3, "hot"))
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model="mistral-small-3", query="invoice",
                          format="openai", messages=[{"role": "user", "content": "amount?"}],
                          deadline_ns=1)  # type: ignore[arg-type]
    resp = assemble(req, offline_result(directive="Be brief.", hot=hits, cold=[]), Engine(CATALOG, Policy()))
    exact = _o200k_prompt(resp, "mistral-small-3", "openai")
    assert resp.prompt_tokens is not None and resp.prompt_tokens >= exact and exact <= _limit(resp)
    assert [p.memory_id for p in resp.packed] == ["small"]


# ----------------------------------------------------------------------------------- images

@pytest.mark.parametrize(("model", "provider_count"), [
    ("gemini-2.0-flash", 16 * 258),  # Gemini 2.x: 258 per 768-px tile, a 3072-px square is 4x4 tiles
    ("mistral-small-3", 64 * 64 + 64),  # Pixtral: a token per 16-px patch plus a break per row
    ("claude-sonnet-4", 1640),  # Anthropic's largest unscaled image
])
def test_low_detail_is_openai_only(model: str, provider_count: int) -> None:
    """``detail: low`` is OpenAI's price; another provider reached through the OpenAI format charges
    a large image by its own rules, so a model OpenAI publishes nothing for is charged as high."""
    from ibex_context.pipeline.counting.image_tokens import openai_image_tokens

    for size in ((3072, 3072), (1024, 1024), (None, None)):
        assert openai_image_tokens(*size, "low", model=model) >= provider_count
        assert openai_image_tokens(*size, "low", model=model) == openai_image_tokens(*size, "high", model=model)
    assert openai_image_tokens(3072, 3072, "low", model="gpt-4o") == 85  # OpenAI's own models keep it
