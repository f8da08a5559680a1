"""Python client library for ibex-context (see ``client.client`` for the contract)."""

# One file, one module: loaded as ``client`` too, every class here would exist twice.
if not __name__.startswith("ibex_context."):
    raise ImportError("import ibex_context.client, not client")

from ..shared.wire.errors import (
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
from ..shared.wire.models import AssembleRequest, AssembleResponse
from .client import AsyncClient, ClientClosed, degraded_response
from .sync import SyncClient

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
