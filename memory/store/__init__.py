"""Memories and directives in Redis: writes, reads, seeding, the raw RESP reader, the directive admin CLI."""
