"""Memories and directives in Redis: the stored record, writes, reads, write quotas, the raw RESP reader,
the directive admin CLI."""
