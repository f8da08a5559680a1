"""What the LiteLLM hook does, without LiteLLM: one client per org, the assembly that replaces a
request's messages, the response headers that say what happened, and the usage report.

``litellm.py`` adapts this to LiteLLM's ``CustomLogger``; keeping LiteLLM out of here lets the
same logic run (and be tested) without the proxy. README "Using it from LiteLLM proxy".

LiteLLM's call id comes from the caller's ``x-litellm-call-id`` header, so two calls may share it:
it is only the assembly's label (``request_id``), never a key. An assembly waiting for its usage is
kept under a key the hook makes (``remember``), carried in the call's record in the request
metadata, so one call's usage can never be reported against another call's (or org's) assembly.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ibex_context.client.client import AsyncClient
from ibex_context.client.integrations.litellm_config import (
    Caller,
    HookConfig,
    Source,
    Unmapped,
    map_model,
    resolve_identity,
)
from ibex_context.client.integrations.litellm_routes import Form
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import ErrorCode, IbexError
from ibex_context.shared.models import AssembleResponse
from ibex_context.shared.settings import Settings

log = logging.getLogger(__name__)

RECORD_KEY = "ibex_context"  # where the outcome is kept in the request's LiteLLM metadata
USAGE_KEY = "usage_key"  # the record's key for the assembly awaiting the call's usage (never a header)
HEADER = "x-ibex-context"
PENDING_MAX = 10_000  # assemblies awaiting their usage report; the oldest go first
STATUS_CODES = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.CONTEXT_OVERFLOW: 400, ErrorCode.FORBIDDEN: 403,
                ErrorCode.UNAUTHENTICATED: 500}


class Refused(Exception):
    """The hook refuses the call: the proxy answers ``status`` with ``message`` (one line)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Pending:
    client: AsyncClient
    assembly: AssembleResponse
    loop: asyncio.AbstractEventLoop


def last_user_text(messages: list[Any], limit: int) -> str:
    """The retrieval query: the text of the latest user message that has text (text parts only;
    an Anthropic user turn of tool results only has none), cut to ``limit``."""
    for msg in reversed(messages):
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
                content = " ".join(t for t in texts if isinstance(t, str))
            if isinstance(content, str) and content:
                return content[:limit]
    return ""


def header_value(text: str, limit: int = 512) -> str:
    """Printable ASCII only (HTTP header values), one line, at most ``limit`` characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]


class HookCore:
    """One ``AsyncClient`` per configured org, each with that org's own key (README: the broker
    checks the org against the key, so one tenant's call can never assemble another's memories)."""

    def __init__(self, config: HookConfig, *, settings: Settings | None = None,
                 catalog: Catalog | None = None) -> None:
        self.config = config
        self.settings = settings or Settings()
        self.catalog = catalog or Catalog.load(self.settings.catalog_path)
        self._clients: dict[str, AsyncClient] = {}
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self.timeout = None if config.timeout_ms is None else config.timeout_ms / 1000
        for org in config.orgs:  # a bad key file or endpoint stops the proxy at start, not per call
            self._clients[org] = self._new_client(org)

    def _new_client(self, org: str) -> AsyncClient:
        entry = self.config.orgs[org]
        update: dict[str, Any] = {"client_key_file": entry.key_file}
        if self.config.broker_public_key is not None:
            update["broker_public_key"] = self.config.broker_public_key
        return AsyncClient(self.config.endpoints, settings=self.settings.model_copy(update=update))

    def caller(self, sources: Mapping[Source, object]) -> Caller | Unmapped:
        """The caller's identity, or why it has none (to pass through); ``Refused`` under
        ``unmapped: refuse``."""
        who = resolve_identity(self.config, sources)
        if isinstance(who, Unmapped):
            if self.config.unmapped == "refuse":
                raise Refused(403, f"ibex-context: no org mapping for this caller: {who.reason}")
            log.info("ibex-context: passing a call through unassembled: %s", who.reason)
        return who

    def model(self, requested: str, deployments: list[str]) -> str:
        try:
            return map_model(self.config, self.catalog, requested, deployments)
        except IbexError as exc:
            raise Refused(400, f"ibex-context: {exc.message}") from None

    async def assemble(self, who: Caller, model: str, form: Form, call_id: object = None) -> AssembleResponse:
        """The assembly for this call's conversation (``assemble_or_degrade``: a service fault
        degrades, a caller fault is ``Refused`` with the service's one-line reason)."""
        fields: dict[str, Any] = {
            "org_id": who.org_id, "agent_id": who.agent_id, "model": model, "format": form.format,
            "query": last_user_text(form.messages, self.config.query_chars), "messages": form.messages,
            "tools": form.tools, "options": self.config.options, "history": self.config.history}
        if form.system is not None:
            fields["system"] = form.system
        if isinstance(call_id, str) and 0 < len(call_id) <= 128:
            fields["request_id"] = call_id  # one id in LiteLLM's logs and the service's: a label, not a key
        try:
            return await self._clients[who.org_id].assemble_or_degrade(
                timeout=self.timeout, fallback_directive=self.config.fallback_directive, **fields)
        except IbexError as exc:
            where = f" ({exc.field})" if exc.field else ""
            raise Refused(STATUS_CODES.get(exc.code, 500),
                          f"ibex-context {exc.code.value}{where}: {exc.message}") from None

    def remember(self, who: Caller, assembly: AssembleResponse) -> str:
        """Keep the assembly until the provider's usage arrives (``report``), under the key returned:
        the hook's own, unguessable and used once (never the caller's call id)."""
        # the report needs the ids, the model and the counts, not the prompt: keep ~1 KB, not the conversation
        slim = assembly.model_copy(update={"messages": None, "system": None, "rendered": "", "sections": [],
                                           "decisions": [], "history": []})
        key = secrets.token_urlsafe(18)
        self._pending[key] = Pending(self._clients[who.org_id], slim, asyncio.get_running_loop())
        while len(self._pending) > PENDING_MAX:
            self._pending.popitem(last=False)
        return key

    def forget(self, key: object) -> Pending | None:
        return self._pending.pop(key, None) if isinstance(key, str) else None

    def report(self, key: object, prompt_tokens: object, cached_tokens: object) -> bool:
        """Send the provider's prompt usage for the assembly ``remember`` kept under ``key`` (fire and
        forget); False if nothing to send."""
        pending = self.forget(key)
        if pending is None or not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool):
            return False
        cached = cached_tokens if isinstance(cached_tokens, int) and not isinstance(cached_tokens, bool) else None

        def go() -> None:  # never raises, never blocks (AsyncClient.report_usage)
            pending.client.report_usage(pending.assembly, prompt_tokens=prompt_tokens, cached_tokens=cached)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is pending.loop:
            go()
        else:  # the client belongs to the loop that assembled
            pending.loop.call_soon_threadsafe(go)
        return True

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


def record(assembly: AssembleResponse | None, status: str, reasons: list[str],
           usage_key: str | None = None) -> dict[str, Any]:
    """What the request's metadata keeps (JSON only: LiteLLM logs it) and the headers are made of,
    with the key of the assembly awaiting the call's usage (``HookCore.remember``; no header shows it)."""
    out: dict[str, Any] = {"status": status, "reasons": reasons}
    if assembly is not None:
        out.update(request_id=assembly.request_id, degraded=assembly.degraded, memories=len(assembly.packed),
                   prompt_tokens=assembly.prompt_tokens, model=assembly.budget.model,
                   count_rule=assembly.budget.count_rule, calibration_samples=assembly.budget.calibration_samples)
    if usage_key is not None:
        out[USAGE_KEY] = usage_key
    return out


def usage_key(kwargs: Mapping[str, Any]) -> object:
    """The key ``remember`` returned for this call, from the record the pre-call hook wrote into the
    request's metadata (LiteLLM hands it back to the logging callbacks in ``litellm_params``)."""
    params = kwargs.get("litellm_params")
    meta = params.get("metadata") if isinstance(params, Mapping) else None
    rec = meta.get(RECORD_KEY) if isinstance(meta, Mapping) else None
    return rec.get(USAGE_KEY) if isinstance(rec, Mapping) else None


def headers(rec: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Response headers from a call's record: ``x-ibex-context`` (assembled, degraded or
    passed_through), the reason when not assembled, and the assembly's id and figures (memories
    packed, prompt tokens, catalog model, the count rule and its calibration samples)."""
    if not rec:
        return None
    out = {HEADER: str(rec.get("status"))}
    if rec.get("reasons"):
        out[f"{HEADER}-reason"] = header_value("; ".join(str(r) for r in rec["reasons"]))
    for key in ("request_id", "memories", "prompt_tokens", "model", "count_rule", "calibration_samples"):
        if rec.get(key) is not None:
            out[f"{HEADER}-{key.replace('_', '-')}"] = header_value(str(rec[key]))
    return out
