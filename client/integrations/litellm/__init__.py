"""The LiteLLM proxy callback: context assembly inside the proxy people already run.

In the proxy's config (docs/litellm.md)::

    litellm_settings:
      callbacks: ibex_context.client.integrations.litellm.proxy_handler

``proxy_handler`` is built on first access from the file named by ``IBEX_LITELLM_CONFIG``, so a
bad config stops the proxy at start with one line.

* pre-call, every call type LiteLLM hands a hook (chat, ``/v1/messages``, ``/v1/responses``,
  embeddings, text completions, files, pass-through routes...): first the caller's org and agent
  from the LiteLLM key's or team's metadata (or the request metadata, as configured; never message
  text); a caller with no org mapping is refused (by default) whatever the route;
* chat completions, ``/v1/messages`` and ``/v1/responses`` (``litellm.routes``): the model mapped
  onto the catalog, then ``assemble_or_degrade`` and the request's conversation replaced with the
  assembled one, in the route's own shape. A service fault degrades, and the caller's
  ``on_degraded`` says what goes out (``litellm.degraded``: by default the agent's directive all
  the same, from the hook's copy); a caller fault or an unknown model is refused with one line.
  An agent outside the mapping's allow-lists is refused (403). Other call types of a mapped
  caller, and requests those forms cannot carry, go on unassembled (``passed_through``, with the
  reason);
* response headers: ``x-ibex-context: assembled | degraded | passed_through``, why, and where
  the directive came from (``x-ibex-context-directive``);
* success: the provider's ``usage.prompt_tokens`` reported back for calibration, streamed or not (a
  chat completion's stream only when it asked for ``stream_options.include_usage``; Anthropic's
  messages and OpenAI's responses always stream their usage); with ``summaries`` configured, a
  compaction summary due after the call is made in the background (``litellm.summary``).

LiteLLM is loaded by ``hook`` when a name above is first read: the package's own parts (``config``,
``auth``, ``routes``...) import without it, and ``ibex_context.client`` never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hook import IbexContextHook as IbexContextHook

__all__ = ["IbexContextHook"]  # and proxy_handler, built on first access (``hook``)


def __getattr__(name: str) -> Any:
    """``IbexContextHook`` and ``proxy_handler`` from ``hook``, loaded (with LiteLLM) on first use."""
    if name not in ("IbexContextHook", "proxy_handler"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import hook

    return getattr(hook, name)
