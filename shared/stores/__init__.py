"""What the service keeps in Redis: every key built in one place, directives, calibration, summaries."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.shared.stores, not shared.stores")
