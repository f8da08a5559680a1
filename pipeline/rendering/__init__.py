"""What the model receives: each request form made one ``Turns`` with its target's renderer (OpenAI,
Anthropic, text), the directive and memory block, emitting and counting exactly what is sent."""
