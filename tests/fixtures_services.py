"""Fixtures that start real backing services (filled in by the backing-services work)."""
