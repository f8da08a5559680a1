"""Python client library for ibex-context (see ``client.client`` for the contract)."""

# One file, one module: loaded as ``client`` too, every class here would exist twice.
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.client, not client")

from ibex_context.client.client import AsyncClient, ClientClosed, degraded_response
from ibex_context.client.sync import SyncClient
from ibex_context.shared.wire.errors import (
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
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse

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
