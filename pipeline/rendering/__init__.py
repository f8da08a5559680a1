"""What the model receives: one renderer per target (OpenAI, Anthropic, text), the directive and
memory block, the text format, emitting and counting exactly what is sent."""
