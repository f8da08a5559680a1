"""A text's MiniLM token states, compressed for the late-interaction rerank (``memory.search.rerank``).

The embedder's forward pass already computes every token's last-layer state before it pools them
into the vector; the rerank compares a question's token states with a memory's (ColBERT's MaxSim).
So the same pass keeps them (``MiniLM.encode_states``; the ONNX graph's ``states`` output), [CLS]
and [SEP] left out, and a memory stores them with its vector:

* each 384-dimension row is L2-normalised, projected to ``DIMS`` (64) dimensions by the shipped
  projection (``data/token-states/projection.npz``: a centre and a ``384 x 64`` basis, fitted
  by ``memory/data/fit_token_projection.py`` on text that is in no evaluation set) and normalised
  again;
* a memory's rows are stored as int8 with one float16 scale per row: a header of two bytes
  (``FORMAT``, ``DIMS``), the int8 rows, then the scales (66 bytes a token; a conversation turn
  of 12 tokens takes ~0.8 KB). A question's rows stay float32 in the service's memory.

``decode`` is total: missing bytes, another format or dimension, or a length that is not whole
rows give ``None``, and the rerank leaves that memory at its relevance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float32]

FORMAT = 1  # first byte of a stored value: bump it whenever the layout or the projection changes
DIMS = 64  # dimensions a token state is projected to
HEADER = bytes((FORMAT, DIMS))
_HEADER_LEN = len(HEADER)
ROW_BYTES = DIMS + 2  # int8 row and its float16 scale
PROJECTION = Path(__file__).resolve().parents[1] / "data" / "token-states" / "projection.npz"


@dataclass(frozen=True, slots=True)
class Embedded:
    """Memories' vectors and, from the same forward pass, their stored token states (``encode``;
    ``None`` for a text without any, or an embedder that has none)."""

    vectors: Array
    states: Sequence[bytes | None]


QueryEmbedding = tuple[Array, Array | None]  # a question's vector and its projected token states


def split_embedded(out: Array | Embedded) -> Embedded:
    """An embedding function's answer as ``Embedded`` (plain vectors carry no token states)."""
    return out if isinstance(out, Embedded) else Embedded(out, [None] * len(out))


@cache
def projection() -> tuple[Array, Array]:
    """``(centre, basis)``: the shipped projection, ``centre`` ``[384]`` and ``basis`` ``[384, DIMS]``."""
    with np.load(PROJECTION) as z:
        centre = np.asarray(z["centre"], dtype=np.float32)
        basis = np.ascontiguousarray(z["basis"], dtype=np.float32)
    if basis.shape[1] != DIMS or centre.shape != (basis.shape[0],):
        raise ValueError(f"{PROJECTION}: basis {basis.shape} and centre {centre.shape} do not fit {DIMS} dimensions")
    return centre, basis


def _unit_rows(x: NDArray[Any]) -> Array:
    return np.asarray(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12), dtype=np.float32)


def project(states: Array) -> Array:
    """Token states ``[tokens, 384]`` as the rerank compares them: unit rows of ``DIMS`` dimensions."""
    if states.shape[0] == 0:
        return np.zeros((0, DIMS), dtype=np.float32)
    centre, basis = projection()
    return _unit_rows((_unit_rows(states) - centre) @ basis)


def encode(states: Array) -> bytes:
    """A memory's token states (``[tokens, 384]``) as stored: projected, int8 with a float16 scale per row."""
    rows = project(states)
    scale = np.maximum(np.abs(rows).max(axis=1), 1e-12) / 127.0
    q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return HEADER + bytes(q.tobytes()) + bytes(scale.astype(np.float16).tobytes())


def stored_bytes(tokens: int) -> int:
    """The bytes ``encode`` writes for ``tokens`` token states (what a memory is charged for them)."""
    return len(HEADER) + ROW_BYTES * tokens if tokens > 0 else 0


def decode(raw: object) -> Array | None:
    """Stored token states as float32 rows ``[tokens, DIMS]``; ``None`` when absent or malformed."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        return None
    raw = bytes(raw)
    body = len(raw) - len(HEADER)
    if body <= 0 or raw[: len(HEADER)] != HEADER or body % ROW_BYTES:
        return None
    n = body // ROW_BYTES
    q = np.frombuffer(raw, dtype=np.int8, count=n * DIMS, offset=len(HEADER)).reshape(n, DIMS)
    scale = np.frombuffer(raw, dtype=np.float16, count=n, offset=len(HEADER) + n * DIMS).astype(np.float32)
    if not np.isfinite(scale.sum()):
        return None
    return q * scale[:, None]  # int8 times float32: float32 rows


def rows_of(raw: object) -> int:
    """How many token states a stored value holds; 0 when absent or malformed (``decode``'s checks
    without decoding)."""
    if not isinstance(raw, bytes):
        return 0
    body = len(raw) - _HEADER_LEN
    if body <= 0 or body % ROW_BYTES or not raw.startswith(HEADER):
        return 0
    return body // ROW_BYTES


def decode_many(raws: Sequence[bytes], counts: Sequence[int]) -> Array | None:
    """Several well-formed values (``rows_of`` gave their ``counts``) as one float32 matrix of all
    their rows, in order: one conversion for a search's candidates instead of one per memory.
    ``None`` if a scale is not finite."""
    body = _HEADER_LEN
    ends = [body + n * DIMS for n in counts]
    q = np.frombuffer(b"".join([r[body:end] for r, end in zip(raws, ends, strict=True)]), dtype=np.int8)
    scale = np.frombuffer(b"".join([r[end:] for r, end in zip(raws, ends, strict=True)]),
                          dtype=np.float16).astype(np.float32)
    if not np.isfinite(scale.sum()):
        return None
    return q.reshape(-1, DIMS) * scale[:, None]
