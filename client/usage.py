"""Usage reports: the provider's prompt count for an assembly, carried back to the service
(docs/assembly.md "Calibrated token counts"). ``AsyncClient.report_usage`` and ``SyncClient.report_usage``
call ``usage_payload`` and send the result without waiting for anything.

A report needs the assembly's tenant, its uncalibrated count of the emitted prompt and the
``assembly_id`` the service issued, which only the service's chat-native assemblies (``format``
set) carry (not the client's local fallback); any other assembly, or a count that is not a
positive integer, is not sent: the reason is returned, logged and counted by the caller, never
raised (the proxy must not fail a user's call over bookkeeping).

``AsyncClient.report_summary`` sends a compaction summary to be stored (protocol SUMMARY, README
"Compaction summaries") the same way: validated here (``summary_payload``) with the wire model
the worker checks it with, sent without waiting, never raising. A refusal by the broker
comes back under a ``usage-`` id and is counted in ``usage_refused`` and logged, as a report's is.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from ..shared.wire.codec import encode
from ..shared.wire.models import AssembleResponse, UsageReport
from ..shared.wire.protocol import MAX_USAGE_BYTES
from ..shared.wire.summary_write import MAX_SUMMARY_BYTES, SummaryWrite

USAGE_ID_PREFIX = "usage-"  # a refusal from the broker comes back under this id: counted, not waited for
USAGE_TTL_NS = 10_000_000_000  # a report the broker receives more than 10 s after it was made is dropped
SUMMARY_ID_PREFIX = f"{USAGE_ID_PREFIX}summary-"  # a refused summary is counted with the refused reports


def _count_problem(name: str, value: Any, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if optional else 1):
        return f"{name} must be {'a non-negative' if optional else 'a positive'} int, got {value!r:.40}"
    return None


def usage_payload(assembly: object, prompt_tokens: object, cached_tokens: object,
                  now_ns: int) -> tuple[bytes | None, str]:
    """(payload, "") for a report that can be sent, else (None, why not)."""
    if not isinstance(assembly, AssembleResponse):
        return None, f"assembly must be an AssembleResponse, got {type(assembly).__name__}"
    problem = (_count_problem("prompt_tokens", prompt_tokens, optional=False)
               or _count_problem("cached_tokens", cached_tokens, optional=True))
    if problem:
        return None, problem
    if assembly.prompt_tokens_uncalibrated is None or not assembly.org_id or not assembly.agent_id:
        return None, ("the assembly has no prompt count to compare (only chat-native assemblies, with format, "
                      "carry one)")
    if assembly.assembly_id is None:
        return None, "the assembly has no assembly_id (only the service's own assemblies are matched to reports)"
    try:
        report = UsageReport.model_validate({
            "request_id": f"{USAGE_ID_PREFIX}{uuid.uuid4().hex}", "org_id": assembly.org_id,
            "agent_id": assembly.agent_id, "deadline_ns": now_ns + USAGE_TTL_NS, "assembly_id": assembly.assembly_id,
            "model": assembly.budget.model, "estimated_tokens": max(1, assembly.prompt_tokens_uncalibrated),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "report"
        return None, f"{where}: {err['msg']}"
    payload = encode(report)
    if len(payload) > MAX_USAGE_BYTES:  # pragma: no cover - every field is bounded far below this
        return None, f"report of {len(payload)} bytes exceeds {MAX_USAGE_BYTES}"
    return payload, ""


def summary_payload(fields: dict[str, Any], now_ns: int) -> tuple[bytes | None, str]:
    """(payload, "") for a summary that can be sent (``fields``: ``SummaryWrite``'s but the
    envelope's id and deadline), else (None, why not)."""
    try:
        write = SummaryWrite.model_validate({**fields, "request_id": f"{SUMMARY_ID_PREFIX}{uuid.uuid4().hex}",
                                             "deadline_ns": now_ns + USAGE_TTL_NS})
    except ValidationError as exc:
        err = exc.errors()[0]
        return None, f"{'.'.join(str(p) for p in err['loc']) or 'summary'}: {err['msg']}"
    payload = encode(write)
    if len(payload) > MAX_SUMMARY_BYTES:  # pragma: no cover - the text's bound keeps it far below
        return None, f"summary of {len(payload)} bytes exceeds {MAX_SUMMARY_BYTES}"
    return payload, ""
