"""The bundled Redis for local stacks and tests: one server with the query engine, or a cluster."""
