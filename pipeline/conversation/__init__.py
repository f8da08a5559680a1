"""Conversations in the provider's own shape (OpenAI, Anthropic): strict models, the reply layout, the
history fitted into the window (a target read through ``fit.TargetCosts``), context editing, the summary."""

# One file, one module (docs/architecture.md "One module per file").
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.pipeline.conversation, not pipeline.conversation")
