"""Search over stored memories: the full-text and vector legs, their fusion, ranking, rerank and cut-off, the index."""
