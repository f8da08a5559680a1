"""What crosses a socket: request and reply models, the msgpack codec, the frame protocol, typed errors."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.shared.wire, not shared.wire")
