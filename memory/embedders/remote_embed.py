"""Embeddings from an OpenAI-compatible ``/v1/embeddings`` endpoint (docs/memory-search.md).

``IBEX_MEMORY_EMBEDDER=openai`` sends every text to embed to ``IBEX_MEMORY_EMBED_URL`` (the base
URL, ``/v1/embeddings`` appended) as ``{"model": IBEX_MEMORY_EMBED_MODEL, "input": [...]}``, so
embedding can run on machines of its own: text-embeddings-inference, vLLM, Ollama, a LiteLLM proxy
and OpenAI itself all serve this route. The vectors are checked (count, dimension, finite) and
L2-normalised here; a failure is an ``EmbeddingFailed`` naming the endpoint's problem (the memory
service answers it with 503), never a memory stored without a vector or a search answered from
nothing.

The dimension is learnt at start from one probe call (or set with ``IBEX_MEMORY_EMBED_DIM``, which
the probe must then match), and is part of the embedder's name, so vectors of another model or
size never mix with these in the index.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
from numpy.typing import NDArray

from .errors import EmbeddingFailed

Vectors = NDArray[np.float32]  # memory.embedders.embed's rows; that module loads this one, so not imported from it

MAX_BATCH = 64  # texts per request: servers commonly cap a request's inputs
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class RemoteEmbedder:
    """An embedder that asks an OpenAI-compatible embeddings endpoint (blocking: run in a thread)."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, dim: int | None = None,
                 min_similarity: float = 0.30, timeout_s: float = 2.0, max_query_chars: int = 2_000) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"IBEX_MEMORY_EMBED_URL must be an http(s) URL, got {url!r}")
        if not model:
            raise ValueError("IBEX_MEMORY_EMBED_MODEL is required with IBEX_MEMORY_EMBEDDER=openai")
        self._endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1") + "/embeddings"
        self._model, self._dim, self._min_similarity = model, dim, min_similarity
        self._max_query_chars = max_query_chars
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    @property
    def name(self) -> str:
        return f"remote-{_NAME_UNSAFE.sub('-', self._model)[:48]}-{self.dim}"

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise RuntimeError("the remote embedder's dimension is known after load()")
        return self._dim

    @property
    def blocking(self) -> bool:
        return True

    @property
    def min_similarity(self) -> float:
        return self._min_similarity

    def load(self) -> None:
        """Probe the endpoint once: it answers, and its dimension is the configured one."""
        got = self._request(["dimension probe"])
        dim = int(got.shape[1])
        if self._dim is not None and dim != self._dim:
            raise EmbeddingFailed(f"embedding endpoint {self._endpoint}: vectors have {dim} dimensions, "
                                f"IBEX_MEMORY_EMBED_DIM is {self._dim}")
        self._dim = dim

    def close(self) -> None:
        self._http.close()

    def embed(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.concatenate([self._request(texts[i:i + MAX_BATCH]) for i in range(0, len(texts), MAX_BATCH)])

    def embed_query(self, text: str) -> Vectors:
        row: Vectors = self.embed([text[: self._max_query_chars]])[0]
        return row

    def _request(self, texts: Sequence[str]) -> Vectors:
        where = f"embedding endpoint {self._endpoint}"
        try:
            r = self._http.post(self._endpoint, json={"model": self._model, "input": list(texts)})
        except httpx.HTTPError as exc:
            raise EmbeddingFailed(f"{where} unreachable: {type(exc).__name__}: {exc}"[:300]) from exc
        if r.status_code != 200:
            raise EmbeddingFailed(f"{where} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            rows = _rows(r.json(), len(texts))
        except (ValueError, TypeError, KeyError) as exc:
            raise EmbeddingFailed(f"{where} sent a malformed answer: {exc}"[:300]) from exc
        if self._dim is not None and rows.shape[1] != self._dim:
            raise EmbeddingFailed(f"{where} sent {rows.shape[1]}-dimensional vectors, expected {self._dim}")
        return rows


def _rows(body: Any, n: int) -> Vectors:
    """The answer's vectors in input order, L2-normalised; ``ValueError`` naming what is wrong."""
    data = body["data"] if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != n:
        raise ValueError(f"expected {n} embeddings in 'data'")
    by_index = sorted(data, key=lambda d: int(d.get("index", 0)) if isinstance(d, dict) else 0)
    vecs = [d["embedding"] if isinstance(d, dict) else None for d in by_index]
    if not all(isinstance(v, list) and v for v in vecs):
        raise ValueError("an embedding is missing or empty")
    dims = {len(v) for v in vecs if isinstance(v, list)}
    if len(dims) != 1:
        raise ValueError(f"embeddings of different sizes {sorted(dims)}")
    m = np.asarray(vecs, dtype=np.float64)
    if not np.isfinite(m).all():
        raise ValueError("an embedding holds a non-finite number")
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    out: Vectors = np.where(norms > 0, m / np.where(norms > 0, norms, 1.0), 0.0).astype(np.float32)
    return out
