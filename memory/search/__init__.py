"""Search over stored memories: the query, full-text and vector legs, their fusion, ranking and cut-off, the index."""
