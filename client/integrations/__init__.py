"""Integrations of the client library into proxies people already run (docs/litellm.md "Using it from
LiteLLM proxy"). Each lives in its own module and imports its proxy only there, so importing
``ibex_context.client`` never loads a proxy framework."""
