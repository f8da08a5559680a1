"""The client library's checks on what a caller passes, all before any socket exists.

Every caller mistake is an ``InvalidRequest`` naming the field (README "The client library"): bad
fields or timeout, text that is not UTF-8, a malformed endpoint, and any use after ``close()``
(``ClientClosed``). The request document is stamped with its deadline and packed here, through
``shared.wire.codec``.
"""

from __future__ import annotations

import math
import re
import uuid
from typing import Any

from pydantic import ValidationError

from ..shared.config.settings import ClientSettings, env_name
from ..shared.wire.codec import encode_document
from ..shared.wire.errors import ERROR_BY_CODE, IbexError, Internal, InvalidRequest
from ..shared.wire.models import AssembleRequest, ErrorReply
from ..shared.wire.protocol import Envelope, pack_header
from ..shared.wire.validation import first_error

# Longest timeout a call accepts: anything longer is a unit mistake (milliseconds passed as seconds),
# and it keeps deadline_ns inside the wire's 64-bit integer.
MAX_TIMEOUT_S = 3600.0
ENDPOINT_FORMS = "tcp://host:port, ipc://path or inproc://name"
_TCP_HOST = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]")

# pydantic messages that would not tell a caller what to fix, in words that do.
_PLAIN_REASONS = {
    "extra_forbidden": "not an AssembleRequest field",
    "string_unicode": "text is not valid UTF-8 (it holds a lone surrogate)",
}


class ClientClosed(InvalidRequest):
    """The client was closed: a call after ``close()``/``aclose()`` is a caller bug, so it raises
    (``assemble_or_degrade`` too: degrading would hide the bug)."""


def load_settings() -> ClientSettings:
    """The client's settings from the environment (only its own variables: a server's are not read);
    a bad ``IBEX_*`` value is an ``InvalidRequest`` naming the variable."""
    try:
        return ClientSettings()
    except ValidationError as exc:
        err = first_error(exc)
        name = env_name(ClientSettings, err.loc[0]) if err.loc else "<settings>"
        raise InvalidRequest(f"setting {name}: {err.message}", field=name) from None


def check_timeout(value: object, name: str) -> float:
    """A timeout in seconds: a finite number in (0, MAX_TIMEOUT_S]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number of seconds, got {type(value).__name__}", field=name)
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequest(f"{name} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}",
                             field=name)
    return float(value)


def parse_endpoints(value: object) -> list[str]:
    """A comma-separated string or a sequence of ZeroMQ endpoints, each checked; at least one."""
    if isinstance(value, str):
        found = [e.strip() for e in value.split(",") if e.strip()]
    elif isinstance(value, list | tuple):
        found = list(value)
    else:
        raise InvalidRequest(f"endpoints must be a str or a list of str, got {type(value).__name__}",
                             field="endpoints")
    if not found:
        raise InvalidRequest(f"endpoints: at least one broker endpoint ({ENDPOINT_FORMS}) is required",
                             field="endpoints")
    for ep in found:
        if not isinstance(ep, str) or not endpoint_ok(ep):
            raise InvalidRequest(f"endpoints: {ep!r} is not a broker endpoint ({ENDPOINT_FORMS})", field="endpoints")
    return found


def endpoint_ok(ep: str) -> bool:
    """Whether libzmq can connect to ``ep`` as written: tcp with a host and a port, ipc, inproc.

    The ``tcp://source;host:port`` form and wildcard hosts are refused: they are bind syntax.
    """
    if ep.startswith(("ipc://", "inproc://")):
        rest = ep.partition("://")[2]
        return bool(rest) and rest.isprintable() and not rest.isspace()
    if not ep.startswith("tcp://"):
        return False
    host, sep, port = ep[len("tcp://"):].rpartition(":")
    return (bool(sep) and _TCP_HOST.fullmatch(host) is not None and port.isascii() and port.isdigit()
            and 0 < int(port) < 65536)


def invalid_fields(exc: ValidationError, request_id: str | None = None) -> InvalidRequest:
    """The first pydantic error as one line naming its field (as the worker's codec names it)."""
    err = first_error(exc, root="<root>", reasons=_PLAIN_REASONS)
    message = f"{err.field}: {err.message}"[:300].replace("\n", " ") + (f" (+{err.more} more)" if err.more else "")
    return InvalidRequest(message, field=err.field, request_id=request_id)


def encode_with_deadline(request: AssembleRequest | None, fields: dict[str, Any],
                         deadline_ns: int) -> tuple[str, bytes]:
    """(request_id, wire payload) with the deadline stamped; a given request is not copied first."""
    rid, _, payload = encode_request(request, fields, deadline_ns)
    return rid, payload


def encode_request(request: AssembleRequest | None, fields: dict[str, Any],
                   deadline_ns: int) -> tuple[str, bytes, bytes]:
    """(request_id, header frame, payload): the header carries the routing fields the broker reads
    (``protocol.pack_header``), the payload the whole request with its deadline stamped."""
    if request is None or fields:
        req = build(request, fields, deadline_ns)  # validates fields; refuses a request plus fields
        doc = req.model_dump(mode="python")
    elif not isinstance(request, AssembleRequest):
        raise InvalidRequest(f"request must be an AssembleRequest, got {type(request).__name__}", field="request")
    else:
        req = request
        doc = request.model_dump(mode="python")
        doc["deadline_ns"] = deadline_ns
    try:
        header = pack_header(Envelope(req.request_id, req.org_id, req.agent_id, deadline_ns))
    except ValueError as exc:
        raise InvalidRequest(f"request header: {exc}", field="<header>", request_id=req.request_id) from None
    return req.request_id, header, encode_document(doc, req.request_id)


def build(request: AssembleRequest | None, fields: dict[str, Any], deadline_ns: int) -> AssembleRequest:
    """A validated request from an ``AssembleRequest`` or from fields; mistakes are ``InvalidRequest``."""
    if request is not None and fields:
        raise InvalidRequest(f"pass either an AssembleRequest or its fields, not both (got {', '.join(fields)})",
                             field="request")
    if request is None:
        rid = fields.get("request_id")
        try:
            return AssembleRequest.model_validate(
                {"request_id": uuid.uuid4().hex, **fields, "deadline_ns": deadline_ns})
        except ValidationError as exc:
            raise invalid_fields(exc, rid if isinstance(rid, str) else None) from None
    if not isinstance(request, AssembleRequest):
        raise InvalidRequest(f"request must be an AssembleRequest, got {type(request).__name__}", field="request")
    return request.model_copy(update={"deadline_ns": deadline_ns})


def to_exc(reply: ErrorReply, request_id: str) -> IbexError:
    """The typed error for an error reply, raised under the caller's request id."""
    cls = ERROR_BY_CODE.get(reply.code, Internal)
    return cls(reply.message, field=reply.field, request_id=request_id)
