"""One error tree for the whole service; each leaf maps to one wire error code.

    IbexError                      INTERNAL
    ├── InvalidRequest             INVALID_REQUEST   (bad frame, bad field, unknown version, too big)
    ├── DeadlineExceeded           DEADLINE_EXCEEDED (expired before, during or instead of the work)
    ├── Overloaded                 OVERLOADED        (broker queue full; retry elsewhere or later)
    │   └── StorageQuotaExceeded   OVERLOADED        (the org's storage budget in Redis is spent)
    ├── Unauthenticated            UNAUTHENTICATED   (no or unknown credential)
    ├── Forbidden                  FORBIDDEN         (credential does not cover this org/agent)
    ├── Unavailable                UNAVAILABLE       (no broker / worker reachable)
    ├── UnknownModel               INVALID_REQUEST   (model not in the capability catalog)
    └── TokenizerMismatch          INTERNAL          (counts of different families/kinds combined)

Library errors (redis, httpx, zmq) are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    OVERLOADED = "OVERLOADED"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    FORBIDDEN = "FORBIDDEN"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"


class IbexError(Exception):
    """Root of every error this service raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, field={self.field!r})"


class InvalidRequest(IbexError):
    code = ErrorCode.INVALID_REQUEST


class DeadlineExceeded(IbexError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Overloaded(IbexError):
    code = ErrorCode.OVERLOADED


class StorageQuotaExceeded(Overloaded):
    """A write the org's storage budget does not allow (``shared.stores.storage``): nothing was
    stored; ``field`` names the setting, and it passes once the org's data shrinks or expires."""

    def __init__(self, message: str, *, field: str | None = None, org_id: str = "") -> None:
        super().__init__(message, field=field)
        self.org_id = org_id


class Unauthenticated(IbexError):
    code = ErrorCode.UNAUTHENTICATED


class Forbidden(IbexError):
    code = ErrorCode.FORBIDDEN


class Unavailable(IbexError):
    code = ErrorCode.UNAVAILABLE


class Internal(IbexError):
    code = ErrorCode.INTERNAL


class ContextOverflow(IbexError):
    """Even the parts that are never dropped (system messages, the latest user turn, the tools)
    do not fit the model's window, or the request asked to fail rather than trim history. The
    message says how many tokens over: a provider call with this prompt would be refused."""

    code = ErrorCode.CONTEXT_OVERFLOW


class UnknownModel(InvalidRequest):
    """The model is not in the capability catalog; we refuse to guess its window."""


class TokenizerMismatch(Internal):
    """Token counts from different tokenizer families or estimate kinds were combined."""


ERROR_BY_CODE: dict[ErrorCode, type[IbexError]] = {
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.INTERNAL: Internal,
    ErrorCode.CONTEXT_OVERFLOW: ContextOverflow,
}
