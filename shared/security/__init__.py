"""Who may call and what they may see: CURVE keys, caller authorization, tenant scoping, address checks."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.shared.security, not shared.security")
