"""Operating the service: the ``ibex-context`` CLI, the stack launcher (supervisord and child
processes), and ``explain``. Not imported by the client library."""

# One file, one module: loaded as ``ops`` too, every class here would exist twice.
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.ops, not ops")
