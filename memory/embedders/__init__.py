"""Text to vectors: the embedder interface, MiniLM on numpy, onnxruntime and OpenVINO, the static
table, a remote embedder."""
