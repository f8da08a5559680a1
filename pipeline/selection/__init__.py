"""Which memories go in: the memory-hit contract, scoring, packing (the DP table, exact-token repair and swaps)."""
