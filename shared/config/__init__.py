"""Settings per role, their generated reference, CLI argument handling, metrics and logs."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.shared.config, not shared.config")
