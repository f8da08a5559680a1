"""Write the token-state projection the late-interaction rerank ships with. Not run by ``make``.

    python memory/data/fit_token_projection.py pca      # PCA of MiniLM token states of docs/*.md
    python memory/data/fit_token_projection.py random   # a fixed random orthogonal basis (no fit)

``memory.embedders.token_states`` projects each token state (384 dimensions, unit rows) to ``DIMS`` before it
is stored as int8. ``pca``: the centre and the first ``DIMS`` principal axes of the last-layer
token states of this repository's own documentation (``docs/*.md`` and ``README.md``, split into
sentences: English prose that is in no evaluation set, so the projection never saw the text it
is scored on). ``random``: no centre and the Q of the QR of a seeded Gaussian matrix.
``python -m bench.late_interaction`` compares both; the shipped file is ``pca``
(docs/memory-search.md "Late-interaction rerank").
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "token-states" / "projection.npz"
SEED = 20_250_601


def corpus() -> list[str]:
    """The documentation's sentences (code blocks and table rows left out), at least 5 words each."""
    sentences: list[str] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", " ", path.read_text(encoding="utf-8"), flags=re.S)
        prose = " ".join(line for line in text.splitlines() if not line.lstrip().startswith(("|", "#")))
        sentences += [s.strip() for s in re.split(r"(?<=[.!?])\s+", prose) if len(s.split()) >= 5]
    return sentences


def fitted(kind: str, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """``(centre, basis)`` of ``kind`` (``pca`` or ``random``) to ``dims`` dimensions."""
    if kind == "random":
        q, _ = np.linalg.qr(np.random.default_rng(SEED).standard_normal((384, dims)))
        return np.zeros(384, dtype=np.float32), q.astype(np.float32)
    from ibex_context.memory.embedders.minilm import MiniLM

    model = MiniLM.from_wheel()
    _, states = model.encode_states(corpus())
    rows = np.concatenate(states)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    centre = rows.mean(0)
    _, _, vt = np.linalg.svd(rows - centre, full_matrices=False)
    print(f"{len(states)} sentences, {len(rows)} token states", file=sys.stderr)
    return centre.astype(np.float32), np.ascontiguousarray(vt[:dims].T, dtype=np.float32)


def main() -> None:
    from ibex_context.memory.embedders.token_states import DIMS

    kind = sys.argv[1] if len(sys.argv) > 1 else "pca"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else OUT
    centre, basis = fitted(kind, DIMS)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, centre=centre, basis=basis)
    print(f"wrote {out} ({kind})", file=sys.stderr)


if __name__ == "__main__":
    main()
