"""Request bodies of the reference memory service (pydantic v2, strict).

Strict like the wire models: a string where a number belongs is a caller bug, not something to
coerce; NaN and infinity are refused; unknown fields are refused, which also means an ``org_id``
in a body is an error (the org comes from the bearer token only). The stored record and the field
types the bodies share with it are ``memory.store.records``'.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from ...shared.wire.models import Ident
from ..store.records import Category, Content, StrictModel, Subject, Timestamp, Unit

MAX_QUERY_CHARS = 100_000
HOT_LIMIT_MAX = 20
SEARCH_LIMIT_MAX = 50


class WriteMemory(StrictModel):
    """Body of ``POST /v1/memories``."""

    agent_id: Ident
    memory_id: Ident | None = None
    content: Content
    category: Category
    confidence: Unit = 0.8
    usefulness: Unit = 0.5
    access_count: Annotated[int, Field(ge=0, le=10**9)] = 0
    created_at: Timestamp | None = None
    hot: bool = False
    salience: Unit | None = None  # default: the confidence
    subject: Subject | None = None  # who the memory is about (default: the speaker of a "Name: text" turn)


class SearchBody(StrictModel):
    """Body of ``POST /v1/memories/search``."""

    query: Annotated[str, StringConstraints(max_length=MAX_QUERY_CHARS)]
    agent_id: Ident
    limit: Annotated[int, Field(ge=0, le=SEARCH_LIMIT_MAX)] = SEARCH_LIMIT_MAX
    # Unset: the service's embedder's own cutoff (Embedder.min_similarity).
    min_similarity: Unit | None = None


class FaultSpec(StrictModel):
    """Body of ``PUT /_faults`` (only with ``--enable-faults``).

    Applied in this order: ``latency_ms`` (sleep first), then the first of ``drop`` (close the
    connection, no response), ``status`` (that status with a JSON error), ``malformed`` (200 with
    truncated JSON), ``huge`` (200 with a valid body of ``huge_bytes``). Latency alone delays a
    normal response.
    """

    endpoint: Literal["hot", "search", "all"]
    latency_ms: Annotated[float, Field(ge=0.0, le=120_000.0, allow_inf_nan=False)] = 0.0
    status: Annotated[int, Field(ge=400, le=599)] | None = None
    malformed: bool = False
    drop: bool = False
    huge: bool = False
    huge_bytes: Annotated[int, Field(ge=1 << 20, le=64 << 20)] = 12 << 20
