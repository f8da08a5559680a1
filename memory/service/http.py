"""Request parsing and error rendering of the memory service's HTTP contract (docs/deploy.md "Backing
services"): strict JSON bodies with a size cap, known query parameters only, the first validation
error named in one line, and every error as ``{"error": message, "field": ...}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ...shared.stores.keys import is_ident
from ...shared.wire.validation import first_error

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """An error the client caused (or must be told about), rendered as ``{"error": ...}``."""

    def __init__(self, status: int, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def error_response(status: int, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]!r} is out of range")
    return value


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Strict JSON: no NaN/Infinity (Python's json accepts them), no overflowing numbers."""
    if not body.strip():
        raise ApiError(400, "request body must be a JSON object")
    try:
        doc = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise ApiError(400, "malformed JSON: nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long, our hooks
        raise ApiError(400, f"malformed JSON: {str(exc)[:200]}") from exc
    if not isinstance(doc, dict):
        raise ApiError(400, "request body must be a JSON object")
    return doc


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise ApiError(413, f"request body over {max_bytes} bytes")
    return bytes(buf)


def validate_body(model: type[M], doc: dict[str, Any]) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = first_error(exc, reasons={"extra_forbidden": "unknown field"})
        if err.kind == "extra_forbidden" and err.field == "org_id":
            raise ApiError(400, "org_id is not accepted: the org comes from the bearer token", field=err.field) from exc
        raise ApiError(400, f"{err.field or 'body'}: {err.message}", field=err.field or None) from exc


def query_params(request: Request, allowed: Sequence[str]) -> dict[str, str]:
    params = request.query_params
    out: dict[str, str] = {}
    for key in params:
        if key == "org_id":
            raise ApiError(400, "org_id is not accepted: the org comes from the bearer token", field=key)
        if key not in allowed:
            raise ApiError(400, f"unknown query parameter {key[:40]!r}", field=key[:40])
        values = params.getlist(key)
        if len(values) != 1:
            raise ApiError(400, f"query parameter {key!r} given more than once", field=key)
        out[key] = values[0]
    return out


def agent_id_param(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, "agent_id is required", field="agent_id")
    if not is_ident(value):
        raise ApiError(400, "agent_id must be 1-64 characters of A-Z a-z 0-9 _ . -", field="agent_id")
    return value
