"""Python client library for ibex-context (see ``client.client`` for the contract)."""

from ibex_context.client.client import AsyncClient, ClientClosed, SyncClient, degraded_response
from ibex_context.shared.errors import (
    ContextOverflow,
    DeadlineExceeded,
    Forbidden,
    IbexError,
    Internal,
    InvalidRequest,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from ibex_context.shared.models import AssembleRequest, AssembleResponse

__all__ = [
    "AssembleRequest",
    "AssembleResponse",
    "AsyncClient",
    "ClientClosed",
    "ContextOverflow",
    "DeadlineExceeded",
    "Forbidden",
    "IbexError",
    "Internal",
    "InvalidRequest",
    "Overloaded",
    "SyncClient",
    "Unauthenticated",
    "Unavailable",
    "degraded_response",
]
