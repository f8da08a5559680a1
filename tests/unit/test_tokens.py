"""Token counting: exact BPE offline, conservative estimates, caching, and family mixing."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting.tokens import CachedCounter, ExactCounter, TokenCount, estimate_tokens
from ibex_context.shared.wire.errors import TokenizerMismatch
from tests.properties import examples

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "token_corpus.json").read_text("utf-8"))


@functools.cache
def reference(encoding: str) -> Any:
    """bpe-openai's own ``Encoding`` (the package's Python path), built once: each
    ``bpe_openai.get_encoding`` call copies and re-indexes the whole vocabulary (~45 ms)."""
    import bpe_openai

    return bpe_openai.get_encoding(encoding)


@pytest.mark.parametrize(("family", "encoding"), [("o200k", "o200k_base"), ("cl100k", "cl100k_base")])
def test_estimate_never_undercounts_exact(family: str, encoding: str) -> None:
    exact = ExactCounter(family, encoding)
    kinds = {"prose", "code", "json", "cjk", "emoji"}
    assert len(CORPUS) >= len(kinds)
    for text in CORPUS:
        assert estimate_tokens(text) >= exact.count(text), text[:60]
    # and every corpus text joined: long mixed documents too
    joined = "\n\n".join(CORPUS)
    assert estimate_tokens(joined) >= exact.count(joined)


def test_exact_counts_known_values() -> None:
    exact = ExactCounter("cl100k", "cl100k_base")
    assert exact.count("hello world") == 2
    assert exact.count("") == 0
    assert exact.count("lone \ud800 surrogate") > 0  # never raises


@given(st.text(max_size=200))
def test_cache_agrees_with_inner(text: str) -> None:
    inner = ExactCounter("o200k", "o200k_base")
    cached = CachedCounter(inner, max_entries=8)
    assert cached.count(text) == inner.count(text)
    assert cached.count(text) == inner.count(text)
    assert cached.hits >= 1


def test_cache_is_bounded_lru() -> None:
    cached = CachedCounter(ExactCounter("o200k", "o200k_base"), max_entries=3)
    for t in ["a", "b", "c", "d"]:
        cached.count(t)
    assert len(cached._cache) == 3
    cached.count("a")
    assert cached.misses == 5


def test_counts_refuse_to_mix() -> None:
    a = TokenCount(3, "o200k", "exact")
    assert (a + TokenCount(4, "o200k", "exact")).n == 7
    with pytest.raises(TokenizerMismatch):
        _ = a + TokenCount(4, "cl100k", "exact")
    with pytest.raises(TokenizerMismatch):
        _ = a + TokenCount(4, "o200k", "estimate")


def test_catalog_counter_per_family() -> None:
    cat = Catalog.load()
    c1 = cat.counter("o200k")
    assert c1 is cat.counter("o200k") and c1.kind == "exact"
    c2 = cat.counter("claude")
    assert c2.kind == "estimate" and c2.count("hello world") >= 2


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from(["alpha", "Beta,", "gamma.", "δelta", "42", " ", "\n", "x-y", "Zoë", "  ", "'s",
                                 "(", "}", "日本"]), min_size=2, max_size=400),
       st.sampled_from(["o200k", "cl100k", "llama3", "qwen"]))
def test_long_text_split_counts_exactly(words: list[str], family: str) -> None:
    """Texts over the encoder's per-call limits are counted in halves split where the pre-tokenizer
    always splits; the halves must add up to the one-call count."""
    from ibex_context.pipeline.counting.tokens import split_point

    inner = Catalog.load().counter(family).inner
    text = " ".join(words)
    if split_point(text) is None:  # nowhere safe to split: charged its bytes, never less than BPE
        assert inner._count_long(text) >= inner.count(text)  # type: ignore[attr-defined]
    else:
        assert inner._count_long(text) == inner.count(text)  # type: ignore[attr-defined]


def test_text_over_the_encoders_limits_is_counted() -> None:
    inner = Catalog.load().counter("o200k").inner
    assert inner.count("hello world, this is a test. " * 60_000) == 480_001  # 1.74M chars, 480K tokens


# ---------------------------------------------------------------- quicktok-v1 (Llama 3, Qwen)

def _real_texts() -> list[str]:
    """The token corpus, the demo memories and this repository's README paragraphs."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    texts = list(json.loads((root / "tests" / "data" / "token_corpus.json").read_text()))
    for line in (root / "memory" / "data" / "demo.jsonl").read_text().splitlines():
        rec = json.loads(line)
        texts += [v for k, v in rec.items() if k in ("content", "text") and isinstance(v, str)]
    readme = (root / "README.md").read_text()
    return [*texts, readme, *readme.split("\n\n")]


SURROGATES = ["lone \ud800 surrogate", "\ud83d\ude00 a pair written as two", "a\udfffb\ud800", ""]


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base"])
def test_exact_counts_are_the_bpe_openai_packages_own(encoding: str) -> None:
    """The OpenAI encodings count on bpe-openai's native tokenizer without the package's Python
    tables (``tokens.OpenAiBpe``): every count is the package's own ``encode_ordinary``, lone
    surrogates included (replaced as the package replaces them)."""

    ref, exact = reference(encoding), ExactCounter(encoding.removesuffix("_base"), encoding)
    for text in [*_real_texts(), *SURROGATES]:
        assert exact.count(text) == len(ref.encode_ordinary(text)), text[:80]


@settings(max_examples=examples(300), deadline=None)
@given(st.text(max_size=300), st.sampled_from(["o200k_base", "cl100k_base"]))
def test_exact_counts_are_the_bpe_openai_packages_own_on_any_text(text: str, encoding: str) -> None:

    exact = ExactCounter(encoding.removesuffix("_base"), encoding)
    assert exact.count(text) == len(reference(encoding).encode_ordinary(text))


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base"])
def test_over_the_per_call_token_limit_a_text_is_split_or_charged_its_bytes(encoding: str) -> None:
    """Under the per-call character limit but over bpe-openai's 200,000 tokens (which the package
    refuses): split where every pre-tokenizer splits, the count stays exact (quicktok's, which has
    no limit); with nowhere to split, the text is charged its UTF-8 bytes."""
    import bpe_openai
    import quicktok

    from ibex_context.pipeline.counting.tokens import MAX_CHARS_PER_CALL, MAX_TOKENS_PER_CALL

    exact = ExactCounter(encoding.removesuffix("_base"), encoding)
    splittable, solid = "a. " * 130_000, "1 " * 200_000
    for text in (splittable, solid):
        assert len(text) < MAX_CHARS_PER_CALL
        with pytest.raises(bpe_openai.TokenLimitError):
            reference(encoding).encode_ordinary(text)
    whole = len(quicktok.get_encoding(encoding).encode_ordinary(splittable))
    assert exact.count(splittable) == whole > MAX_TOKENS_PER_CALL
    assert exact.count(solid) == len(solid.encode("utf-8"))


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base"])
def test_quicktok_matches_bpe_openai_token_for_token_on_real_text(encoding: str) -> None:
    """quicktok-v1 is trusted for llama3/qwen3 only because its OpenAI encoders agree exactly with
    bpe-openai (docs/assembly.md "Calibrated token counts")."""
    import quicktok

    qt, ref = quicktok.get_encoding(encoding), reference(encoding)
    for text in _real_texts():
        assert list(qt.encode_ordinary(text)) == list(ref.encode_ordinary(text)), text[:80]


@settings(max_examples=examples(300), deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cn"]), max_size=300),
       st.sampled_from(["o200k_base", "cl100k_base"]))
def test_quicktok_matches_bpe_openai_on_any_text(text: str, encoding: str) -> None:
    """Any text of characters assigned in this Python's Unicode database. Code points it leaves
    unassigned are assigned in later Unicode versions, and the two libraries' regex tables disagree
    on some of them (``"\U000323b0/A"``: one token for "/A" against two), a difference of a token
    per such character that the counts' safety buffer absorbs."""
    import quicktok

    assert list(quicktok.get_encoding(encoding).encode_ordinary(text)) == \
        list(reference(encoding).encode_ordinary(text))


def test_llama3_and_qwen_vocabularies_are_the_published_ones() -> None:
    cat = Catalog.load()
    llama, qwen = cat.counter("llama3"), cat.counter("qwen")
    assert llama.kind == qwen.kind == "exact"
    import quicktok

    assert list(quicktok.get_encoding("llama3").encode_ordinary("Hello world")) == [9906, 1917]
    assert list(quicktok.get_encoding("qwen3").encode_ordinary("Hello world")) == [9707, 1879]
    assert quicktok.get_encoding("llama3").n_vocab == 128_256 and quicktok.get_encoding("qwen3").n_vocab == 151_669
    assert llama.count("a\ud800b") == llama.count("a\ufffdb")  # a lone surrogate counts as its replacement
    light = Catalog.load(slow_vocabularies=False)  # the client fallback: estimated, never a stall
    assert light.counter("llama3").kind == "estimate" and light.families["qwen"].estimate_factor == 1.2
