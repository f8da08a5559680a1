"""What the LiteLLM hook does, without LiteLLM: one client per org, the assembly that replaces a
request's messages, the response headers that say what happened, and the usage report.

``litellm.py`` adapts this to LiteLLM's ``CustomLogger``; keeping LiteLLM out of here lets the
same logic run (and be tested) without the proxy. docs/litellm.md. What a
degraded assembly becomes (``on_degraded``) is ``settle``'s, with ``litellm.degraded``.

LiteLLM's call id comes from the caller's ``x-litellm-call-id`` header, so two calls may share it:
it is only the assembly's label (``request_id``), never a key. An assembly waiting for its usage is
kept under a key the hook makes (``remember``), carried in the call's record in the request
metadata, so one call's usage can never be reported against another call's (or org's) assembly.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....pipeline.budget.catalog import Catalog
from ....shared.config.settings import ClientSettings
from ....shared.wire.chat_query import last_user_text
from ....shared.wire.errors import ErrorCode, IbexError, Unavailable
from ....shared.wire.models import AssembleResponse
from ...client import AsyncClient, degraded_response
from ...degrade import fetched_directive
from ...requests import build
from . import degraded as D
from .config import (
    Caller,
    Denied,
    HookConfig,
    Source,
    Unmapped,
    context_editing_for,
    map_model,
    resolve_identity,
)
from .routes import Form
from .summary import Summarizer

log = logging.getLogger(__name__)

RECORD_KEY = "ibex_context"  # where the outcome is kept in the request's LiteLLM metadata
USAGE_KEY = "usage_key"  # the record's key for the assembly awaiting the call's usage (never a header)
SUMMARY_TICKET = "summary_ticket"  # the record's key for a summary due on the call's success (never a header)
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


@dataclass(frozen=True, slots=True)
class Settled:
    """What a call goes out with: the assembly, where its directive came from (``litellm.degraded``:
    service, none, copy, configured, absent, off) and the copy's age."""

    assembly: AssembleResponse
    directive: str
    directive_age_s: float | None = None
    reasons: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Pending:
    client: AsyncClient
    assembly: AssembleResponse
    loop: asyncio.AbstractEventLoop


def header_value(text: str, limit: int = 512) -> str:
    """Printable ASCII only (HTTP header values), one line, at most ``limit`` characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]


class HookCore:
    """One ``AsyncClient`` per configured org, each with that org's own key (the broker checks
    the org against the key, so one tenant's call can never assemble another's memories:
    docs/security.md "Authentication")."""

    def __init__(self, config: HookConfig, *, settings: ClientSettings | None = None,
                 catalog: Catalog | None = None) -> None:
        self.config = config
        self.settings = settings or ClientSettings()
        self.catalog = catalog or Catalog.load(self.settings.catalog_path)
        self._clients: dict[str, AsyncClient] = {}
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self.copies = D.DirectiveCopies(config.directive_copies)
        self._counting = threading.Lock()  # the catalog's count caches are not thread-safe
        self.summaries = Summarizer(config.summaries) if config.summaries is not None else None
        for org in config.orgs:  # a bad key file or endpoint stops the proxy at start, not per call
            self._clients[org] = self._new_client(org)

    def _new_client(self, org: str) -> AsyncClient:
        entry = self.config.orgs[org]
        update: dict[str, Any] = {"client_key_file": entry.key_file}
        if self.config.broker_public_key is not None:
            update["broker_public_key"] = self.config.broker_public_key
        # the hook keeps its own directive copies, under its callers' on_degraded policies
        return AsyncClient(self.config.endpoints, settings=self.settings.model_copy(update=update),
                           directive_copies=False)

    def caller(self, sources: Mapping[Source, object]) -> Caller | Unmapped:
        """The caller's identity, or why it has none (to pass through); ``Refused`` under
        ``unmapped: refuse``, and always for a mapping that denies the call."""
        who = resolve_identity(self.config, sources)
        if isinstance(who, Denied):
            raise Refused(403, f"ibex-context: {who.reason}")
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

    async def assemble(self, who: Caller, model: str, form: Form, call_id: object = None,
                       summary_key: str | None = None) -> Settled:
        """The assembly for this call's conversation (``assemble_or_degrade``: a service fault
        degrades, a caller fault is ``Refused`` with the service's one-line reason), settled by the
        caller's ``on_degraded``."""
        fields: dict[str, Any] = {
            "org_id": who.org_id, "agent_id": who.agent_id, "model": model, "format": form.format,
            "query": last_user_text(form.messages, self.config.query_chars), "messages": form.messages,
            "tools": form.tools, "options": self.config.options,
            "history": context_editing_for(self.config, who, form.route)}
        if form.system is not None:
            fields["system"] = form.system
        if summary_key is not None:  # the worker loads the conversation's stored summary (litellm.summary)
            fields["summary_key"] = summary_key
        if isinstance(call_id, str) and 0 < len(call_id) <= 128:
            fields["request_id"] = call_id  # one id in LiteLLM's logs and the service's: a label, not a key
        fallback = self.fallback(who)
        try:
            client = self._clients[who.org_id]
            assembly = await client.assemble_or_degrade(
                timeout=self.config.call_timeout_s(form.chars, client.default_timeout * 1000),
                fallback_directive=fallback.text if fallback and fallback.text else None, **fields)
            return await self.settle(who, fields, assembly, fallback)  # which may build the prompt again
        except IbexError as exc:
            where = f" ({exc.field})" if exc.field else ""
            raise Refused(STATUS_CODES.get(exc.code, 500),
                          f"ibex-context {exc.code.value}{where}: {exc.message}") from None

    def fallback(self, who: Caller) -> D.Fallback | None:
        """The directive a degraded call of ``who`` would go out with: the hook's copy of the agent's
        (``fallback_directive`` policy), else the config's ``fallback_directive``."""
        copy = self.copies.get(who.org_id, who.agent_id) if who.on_degraded == "fallback_directive" else None
        configured = self.config.fallback_directive
        return copy or (D.Fallback(configured, D.CONFIGURED) if configured is not None else None)

    async def settle(self, who: Caller, fields: dict[str, Any], assembly: AssembleResponse,
                     fallback: D.Fallback | None) -> Settled:
        """What the call goes out with, by the caller's ``on_degraded`` (``litellm.degraded``);
        ``Refused`` (503) when the policy or a missing directive says so."""
        fetched = fetched_directive(assembly)
        if fetched is not None:
            self.copies.keep(who.org_id, who.agent_id, fetched)
        reasons = list(assembly.degraded_reasons)
        off = not self.config.options.include_directive
        found = D.OFF if off else D.SERVICE if fetched else D.NONE
        if not assembly.degraded:
            return Settled(assembly, found, reasons=reasons)
        why = reasons[0] if reasons else "degraded"
        if who.on_degraded == "refuse":
            raise Refused(503, f"ibex-context: the context service could not assemble this call ({why}); "
                               "on_degraded is refuse for this caller")
        if fetched is not None or off:  # the directive is there (or not wanted); memories may be missing
            return Settled(assembly, found, reasons=reasons)
        if who.on_degraded == "pass":
            if fallback is not None and D.carries_directive(assembly):
                return Settled(assembly, D.CONFIGURED, reasons=[*reasons, D.source_note(fallback)])
            return Settled(assembly, D.ABSENT, reasons=reasons)
        if fallback is None:
            raise Refused(503, f"ibex-context: the context service could not assemble this call ({why}) and the "
                               f"hook holds no copy of agent {who.agent_id!r}'s directive (nor a fallback_directive); "
                               "on_degraded is fallback_directive for this caller")
        if fallback.text and not D.carries_directive(assembly):
            # the worker answered without the directive (its branch failed): the prompt again, with it
            assembly = await asyncio.to_thread(self._with_directive, fields, fallback.text, why)
        return Settled(assembly, fallback.source if fallback.text else D.NONE, fallback.age_s,
                       [*reasons, D.source_note(fallback)])

    def _with_directive(self, fields: dict[str, Any], directive: str, why: str) -> AssembleResponse:
        """The client's degraded assembly of this call, with ``directive`` (on a thread: it counts)."""
        req = build(None, fields, time.time_ns() + 1_000_000_000)
        with self._counting:
            return degraded_response(req, Unavailable(why), directive, catalog=self.catalog, settings=self.settings)

    def plan_summary(self, rec: dict[str, Any], who: Caller, key: str, form: Form,
                     assembly: AssembleResponse) -> None:
        """Note in the call's record a summary due on its success (``litellm.summary``: made then,
        in the background), and the covers the placed summary has."""
        if assembly.summary is not None and assembly.summary.placed:
            rec["summary_covers"] = assembly.summary.covers
        if self.summaries is None:
            return
        planned = self.summaries.plan(who.org_id, who.agent_id, key, form.format, form.messages, assembly,
                                      self._clients[who.org_id])
        if planned is not None:
            rec[SUMMARY_TICKET], rec["summary_due"] = planned

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
           usage_key: str | None = None, settled: Settled | None = None) -> dict[str, Any]:
    """What the request's metadata keeps (JSON only: LiteLLM logs it) and the headers are made of,
    with the key of the assembly awaiting the call's usage (``HookCore.remember``; no header shows it)."""
    out: dict[str, Any] = {"status": status, "reasons": reasons}
    if settled is not None:
        out["directive"] = settled.directive
        if settled.directive_age_s is not None:
            out["directive_age_s"] = int(settled.directive_age_s)
    if assembly is not None:
        out.update(request_id=assembly.request_id, degraded=assembly.degraded, memories=len(assembly.packed),
                   prompt_tokens=assembly.prompt_tokens, model=assembly.budget.model,
                   count_rule=assembly.budget.count_rule, calibration_samples=assembly.budget.calibration_samples)
    if usage_key is not None:
        out[USAGE_KEY] = usage_key
    return out


def usage_key(kwargs: Mapping[str, Any], name: str = USAGE_KEY) -> object:
    """The key ``remember`` returned for this call (or, ``name`` SUMMARY_TICKET, its summary's
    ticket), from the record the pre-call hook wrote into the request's metadata (LiteLLM hands it
    back to the logging callbacks in ``litellm_params``)."""
    params = kwargs.get("litellm_params")
    meta = params.get("metadata") if isinstance(params, Mapping) else None
    rec = meta.get(RECORD_KEY) if isinstance(meta, Mapping) else None
    return rec.get(name) if isinstance(rec, Mapping) else None


def headers(rec: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Response headers from a call's record: ``x-ibex-context`` (assembled, degraded or
    passed_through), the reason when not assembled, and the assembly's id and figures (memories
    packed, prompt tokens, catalog model, the count rule and its calibration samples, where the
    directive came from and the age of the hook's copy when it was one)."""
    if not rec:
        return None
    out = {HEADER: str(rec.get("status"))}
    if rec.get("reasons"):
        out[f"{HEADER}-reason"] = header_value("; ".join(str(r) for r in rec["reasons"]))
    for key in ("request_id", "memories", "prompt_tokens", "model", "count_rule", "calibration_samples", "directive",
                "directive_age_s", "summary_covers", "summary_due"):
        if rec.get(key) is not None:
            out[f"{HEADER}-{key.replace('_', '-')}"] = header_value(str(rec[key]))
    return out
