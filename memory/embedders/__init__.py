"""Text to vectors: the embedder interface, MiniLM on numpy (the reference) and OpenVINO, the static
table, a remote embedder; their settings and errors."""
