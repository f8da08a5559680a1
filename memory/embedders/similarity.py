"""The retrieval-time cosine cutoff an embedder without a measured one of its own uses."""

from __future__ import annotations

# The spec's cutoff (docs/selection-quality.md): a vector candidate under it that holds no word of
# the question is dropped before hydration. minilm and a remote model set their own.
DEFAULT_MIN_SIMILARITY = 0.70
