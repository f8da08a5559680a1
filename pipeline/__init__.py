"""The pure assembly pipeline: budget, scoring, packing, formatting and the response (docs/architecture.md
"Processes and data flow"). No I/O here: the worker calls it after retrieval, ``ops explain``
on a file, and the client for its degraded response, so ``import ibex_context.client`` must not
pull in aiohttp, redis or the worker (tests/meta/test_client_imports.py)."""

# One file, one module: loaded as ``pipeline`` too, every class here would exist twice.
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.pipeline, not pipeline")
