"""``IBEX_MEMORY_EMBEDDER=static``: a static embedding distilled from all-MiniLM-L6-v2 (model2vec-style).

One vector per vocabulary token, shipped in ``memory/data/static-minilm/`` (``vectors.npz``:
30,522 x 128 int8 rows and their scales, made once by ``memory/data/distill_static.py``; the
model's ``tokenizer.json``). A text is the mean of its tokens' rows, L2-normalised: tens of
microseconds, no network, numpy and ``tokenizers`` only. Weaker than the full network on
reworded questions (docs/selection-quality.md has the measurements).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from .minilm import load_tokenizer
from .similarity import DEFAULT_MIN_SIMILARITY

DATA = Path(__file__).resolve().parents[1] / "data" / "static-minilm"
Array = NDArray[np.float32]


class StaticEmbedder:
    """Mean of distilled token vectors; loaded on first use (about 20 ms)."""

    def __init__(self, data: Path = DATA) -> None:
        self._data = data
        self._rows: Array | None = None
        self._tok: object = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "static-minilm-128"

    @property
    def dim(self) -> int:
        return 128

    @property
    def blocking(self) -> bool:
        return False

    @property
    def min_similarity(self) -> float:
        return DEFAULT_MIN_SIMILARITY  # its cosines barely separate: 0.30 packs ~39 noise hits per question

    def load(self) -> None:
        with self._lock:
            if self._rows is None:
                with np.load(self._data / "vectors.npz") as z:
                    rows = z["vectors"].astype(np.float32) * z["scale"][:, None]
                self._tok = load_tokenizer((self._data / "tokenizer.json").read_text(encoding="utf-8"))
                self._rows = np.ascontiguousarray(rows, dtype=np.float32)

    def embed(self, texts: Sequence[str]) -> Array:
        self.load()
        assert self._rows is not None
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)  # type: ignore[attr-defined]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
        if lengths.sum() == 0:
            return out
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encs])
        rows = self._rows[ids]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        full = lengths > 0
        out[full] = np.add.reduceat(rows, starts[full], axis=0)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return np.asarray(out / np.maximum(norms, 1e-12), dtype=np.float32)

    def embed_query(self, text: str) -> Array:
        return np.asarray(self.embed([text])[0], dtype=np.float32)
