# One file, one module: loaded as ``shared`` too, every class here would exist twice.
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.shared, not shared")
