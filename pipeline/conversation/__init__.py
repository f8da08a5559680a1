"""Conversations in the provider's own shape (OpenAI, Anthropic): strict models, images, the reply layout."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.pipeline.conversation, not pipeline.conversation")
