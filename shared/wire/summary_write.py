"""A compaction summary sent to be stored (protocol SUMMARY; README "Compaction summaries").

Made off the call path (the LiteLLM hook's success callback), sent fire-and-forget through the
broker, which authorizes ``org_id``/``agent_id`` as it does a request's; the worker validates it
again with this model and stores it under ``{org}:summary:{agent}:{summary_key}`` only when its
``covers`` is greater than the stored one's. ``as_memory`` also writes it to the agent's memories.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from .base import WireModel as _Wire
from .models import (
    MAX_SUMMARY_CHARS,
    PROTOCOL_VERSION,
    SUMMARY_KEY_CHARS,
    Ident,
    RequestId,
)

SUMMARY_ID_PREFIX = "summary-"  # a refusal from the broker comes back under this id: counted, not waited for
MAX_SUMMARY_TTL_S = 30 * 86_400
MAX_SUMMARY_BYTES = 160 * 1024  # the payload: a text of at most 32,000 characters (up to 4 bytes each) and ids


class SummaryWrite(_Wire):
    """One summary to store. ``covers`` counts the conversation's leading non-system messages it
    replaces (on a unit boundary, as the service's reply reports them); ``made_at`` is epoch
    seconds (the memory's date); ``ttl_s`` may shorten the store's own TTL, never lengthen it."""

    v: Annotated[int, Field(ge=1)] = PROTOCOL_VERSION
    request_id: RequestId
    org_id: Ident
    agent_id: Ident
    deadline_ns: Annotated[int, Field(gt=0)]  # the broker drops a summary it receives after this
    summary_key: Annotated[str, StringConstraints(pattern=f"^{SUMMARY_KEY_CHARS}$")]
    text: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SUMMARY_CHARS)]
    covers: Annotated[int, Field(ge=1, le=10_000)]
    made_at: Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False)] | None = None
    as_memory: bool = False
    ttl_s: Annotated[int, Field(ge=1, le=MAX_SUMMARY_TTL_S)] | None = None
