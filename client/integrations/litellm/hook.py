"""The LiteLLM callback itself (``IbexContextHook``) and ``proxy_handler``, the instance LiteLLM's
config names (the package's docstring says what it does on each call). LiteLLM is imported here
and by the modules this one reads LiteLLM's types from; the package's other parts load without it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from ....shared.config.settings import ClientSettings
from .config import (
    CONFIG_ENV,
    HookConfig,
    HookConfigError,
    Source,
    Unmapped,
    load_config,
)
from .core import (
    RECORD_KEY,
    SUMMARY_TICKET,
    HookCore,
    Refused,
    headers,
    record,
    usage_key,
)
from .responses import Unconvertible
from .routes import (
    ANTHROPIC_CALLS,
    RESPONSES_CALLS,
    NotAssembled,
    request_form,
)
from .summary import conversation_key

log = logging.getLogger(__name__)

__all__ = ["IbexContextHook"]  # and proxy_handler, built on first access (__getattr__)


def _meta_key(data: Mapping[str, Any]) -> str:
    """Where LiteLLM keeps its metadata for this request: ``litellm_metadata`` on the routes where
    ``metadata`` is the provider's own field (``/v1/messages``, ``/v1/responses``, files, batches),
    else ``metadata``."""
    return "litellm_metadata" if isinstance(data.get("litellm_metadata"), dict) else "metadata"


def _metadata(data: dict[str, Any]) -> dict[str, Any]:
    key = _meta_key(data)
    meta = data.get(key)
    if not isinstance(meta, dict):
        meta = data[key] = {}
    return meta


def _sources(user_api_key_dict: Any, data: dict[str, Any]) -> dict[Source, object]:
    """The metadata the identity may come from: the key's, its team's, and what the caller sent."""
    meta = data.get(_meta_key(data))
    sent = meta.get("requester_metadata", meta) if isinstance(meta, dict) else {}
    return {"key": getattr(user_api_key_dict, "metadata", None),
            "team": getattr(user_api_key_dict, "team_metadata", None), "request": sent}


def _deployments(model_group: str, team_id: object) -> list[str]:
    """``litellm_params.model`` of each deployment a LiteLLM model name routes to (its
    ``model_group_alias`` target's, a team's own); a wildcard deployment (``openai/*``) stands for
    the requested name itself."""
    try:
        from litellm.proxy import proxy_server

        router = proxy_server.llm_router
        found = (router.get_model_list(model_name=model_group, team_id=team_id if isinstance(team_id, str) else None)
                 if router is not None else None)
    except Exception as exc:  # no proxy around this callback (a script's litellm.acompletion)
        log.debug("no LiteLLM router to read deployments from: %s", exc)
        return []
    models = [d.get("litellm_params", {}).get("model") for d in found or []]
    return [model_group if "*" in m else m for m in models if isinstance(m, str)]


def _get(obj: object, name: str) -> object:
    """A field of LiteLLM's response or usage, an object or a dict (a streamed ``/v1/responses``
    call's usage is a dict)."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _streams_usage(kwargs: dict[str, Any]) -> bool:
    """Whether a streamed call's provider sends its usage in the stream: Anthropic's messages
    (``message_start``, ``message_delta``) and OpenAI's responses (``response.completed``) always
    do; a chat completion only when it asked (``stream_options.include_usage``)."""
    if kwargs.get("call_type") in ANTHROPIC_CALLS | RESPONSES_CALLS:
        return True
    options = kwargs.get("stream_options") or (kwargs.get("optional_params") or {}).get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class IbexContextHook(CustomLogger):
    """A LiteLLM ``CustomLogger`` that assembles each chat completion's context (module docstring)."""

    def __init__(self, config: HookConfig, *, settings: ClientSettings | None = None) -> None:
        super().__init__()
        self.core = HookCore(config, settings=settings)

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: str) -> dict[str, Any]:
        meta = _metadata(data)
        try:
            # the identity policy comes first, on every call type: no route is a way around it
            who = self.core.caller(_sources(user_api_key_dict, data))
            if isinstance(who, Unmapped):
                meta[RECORD_KEY] = record(None, "passed_through", [f"no org mapping for this caller: {who.reason}"])
                return data
            form = request_form(call_type, data)
            if isinstance(form, str):
                meta[RECORD_KEY] = record(None, "passed_through", [form])
                return data
            requested = str(data.get("model"))
            model = self.core.model(requested, _deployments(requested, getattr(user_api_key_dict, "team_id", None)))
            key = (conversation_key(meta, data, who.org_id, who.agent_id, form.messages)
                   if self.core.summaries is not None else None)
            settled = await self.core.assemble(who, model, form, data.get("litellm_call_id"), key)
        except Refused as exc:
            raise HTTPException(status_code=exc.status, detail=exc.message) from None
        assembly = settled.assembly
        try:
            form.write(data, assembly)  # in the route's own shape
        except (NotAssembled, Unconvertible) as exc:  # pragma: no cover - a chat request always answers messages
            raise HTTPException(status_code=500, detail=f"ibex-context: {exc}") from None
        status = "degraded" if assembly.degraded else "assembled"
        # the usage is matched to this assembly by the hook's own key, not LiteLLM's call id (the caller's)
        meta[RECORD_KEY] = record(assembly, status, settled.reasons, self.core.remember(who, assembly), settled)
        if key is not None:  # planned now, made on the call's success, in the background
            self.core.plan_summary(meta[RECORD_KEY], who, key, form, assembly)
        return data

    async def async_post_call_response_headers_hook(
            self, data: dict[str, Any], user_api_key_dict: Any, response: Any,
            request_headers: Any = None) -> dict[str, str] | None:
        meta = data.get(_meta_key(data))
        return headers(meta.get(RECORD_KEY) if isinstance(meta, dict) else None)

    async def async_log_success_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        if self.core.summaries is not None:
            self.core.summaries.launch(usage_key(kwargs, SUMMARY_TICKET))
        if kwargs.get("stream") and not _streams_usage(kwargs):
            # LiteLLM fills a stream's usage with its own count when the provider sent none: not
            # the provider's, so not a calibration sample
            self.core.forget(usage_key(kwargs))
            return
        usage = _get(response_obj, "usage")
        self.core.report(usage_key(kwargs), _get(usage, "prompt_tokens"),
                         _get(_get(usage, "prompt_tokens_details"), "cached_tokens"))

    async def async_log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                                      end_time: Any) -> None:
        self.core.forget(usage_key(kwargs))
        if self.core.summaries is not None:
            self.core.summaries.forget(usage_key(kwargs, SUMMARY_TICKET))


_handler: IbexContextHook | None = None


def __getattr__(name: str) -> Any:
    """``proxy_handler``: the hook configured from ``IBEX_LITELLM_CONFIG``, built once on first use."""
    global _handler
    if name != "proxy_handler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _handler is None:
        settings = ClientSettings()
        path = settings.litellm_config
        if not path:
            raise HookConfigError(f"{CONFIG_ENV} is not set: point it at the hook's YAML or JSON config "
                                  "(docs/litellm.md)")
        _handler = IbexContextHook(load_config(path), settings=settings)
    return _handler
