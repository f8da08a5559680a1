"""The one msgpack codec. Decoding never raises: bad bytes become an ``ErrorReply`` value.

Limits are applied inside the unpacker (``max_buffer_size`` and friends) so a giant or deeply
nested payload is refused before Python objects are built for it.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgpack
import ormsgpack
from pydantic import BaseModel, ValidationError

from ..config.settings import default_max_request_bytes
from ..stores.keys import is_ident
from .errors import ErrorCode, IbexError, InvalidRequest
from .models import PROTOCOL_VERSION, AssembleRequest, AssembleResponse, ErrorReply
from .protocol.layouts import Envelope, version_error
from .validation import first_error

DEFAULT_MAX_BYTES = default_max_request_bytes()  # settings.max_request_bytes overrides
MAX_DEPTH = 32
# Request fields that carry free-form JSON (tool schemas, a chat conversation): walked for depth
# and for values JSON cannot carry before the model sees them.
FREE_FORM = ("tool_schemas", "messages", "system", "tools")

M = TypeVar("M", bound=BaseModel)


def encode(model: BaseModel) -> bytes:
    """Serialize a wire model to msgpack (exclude nothing: the wire is explicit).

    ormsgpack reads the model's fields directly (no intermediate dict): the same bytes as
    ``msgpack.packb(model.model_dump())`` for every wire model, which have no custom serializers
    (tests/unit/test_codec.py compares them), at about a third of the CPU of a reply. A value it
    refuses (text that is not UTF-8, an int past 64 bits) takes the dump path, so what fails, and
    how, is msgpack's."""
    try:
        return ormsgpack.packb(model, option=_PACK_OPTIONS)
    except ormsgpack.MsgpackEncodeError:
        return msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)  # type: ignore[no-any-return]


_PACK_OPTIONS = ormsgpack.OPT_SERIALIZE_PYDANTIC


def encode_document(doc: dict[str, Any], request_id: str) -> bytes:
    """msgpack a dumped model document (the client's request with its deadline stamped, the
    bench worker's canned reply); a value msgpack refuses is an ``InvalidRequest`` naming its path."""
    try:
        return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError) as exc:
        path, why = _first_unpackable(doc) or ("<payload>", f"cannot be encoded ({type(exc).__name__})")
        raise InvalidRequest(f"{path}: {why}", field=path, request_id=request_id) from None


def _first_unpackable(obj: Any, path: str = "") -> tuple[str, str] | None:
    """(path, why) of the first value msgpack cannot carry: text that is not UTF-8 (a lone
    surrogate), an integer outside 64 bits, a type msgpack has no form for."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        cur, p = stack.pop()
        where = p or "<root>"
        if isinstance(cur, dict):
            if not all(isinstance(k, str) for k in cur):
                return where, "map keys must be strings"
            for k, v in reversed(cur.items()):
                stack.append((k, where))
                stack.append((v, f"{p}.{k}" if p else k))
        elif isinstance(cur, list | tuple):
            stack.extend((v, f"{p}[{i}]") for i, v in reversed(list(enumerate(cur))))
        elif (why := _scalar_problem(cur)) is not None:
            return where, why
    return None


def _scalar_problem(value: Any) -> str | None:
    """Why msgpack cannot carry ``value`` (not a map or a list), or None when it can."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "text is not valid UTF-8 (it holds a lone surrogate)"
        return None
    if isinstance(value, bool) or value is None or isinstance(value, float | bytes | bytearray):
        return None
    if isinstance(value, int):
        return None if -(1 << 63) <= value < (1 << 64) else "integer does not fit in 64 bits"
    return f"a {type(value).__name__} cannot be sent (JSON-like values only)"


def encode_error(exc: IbexError | ErrorReply, request_id: str | None = None) -> bytes:
    if isinstance(exc, ErrorReply):
        return encode(exc)
    return encode(
        ErrorReply(request_id=request_id or exc.request_id, code=exc.code, message=exc.message, field=exc.field)
    )


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth, stopping early past ``limit`` (iterative: no recursion on hostile input)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    deepest = 0
    while stack:
        cur, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(cur, dict):
            stack.extend((v, d + 1) for v in cur.values())
        elif isinstance(cur, list):
            stack.extend((v, d + 1) for v in cur)
    return deepest


def _first_non_json(obj: Any, path: str = "") -> tuple[str, str] | None:
    """(path, why) of the first value JSON cannot carry (NaN/inf, binary, a binary map key), else
    None. Tool schemas are re-serialized as JSON for counting and formatting, so these must be
    refused at the door rather than fail inside a worker."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        cur, p = stack.pop()
        if isinstance(cur, float) and not math.isfinite(cur):
            return p or "<root>", "NaN and infinity are not accepted"
        if isinstance(cur, bytes | bytearray):
            return p or "<root>", "binary values are not accepted in JSON data"
        if isinstance(cur, dict):
            for k, v in cur.items():
                if not isinstance(k, str):
                    return p or "<root>", "map keys must be strings"
                stack.append((v, f"{p}.{k}" if p else k))
        elif isinstance(cur, list):
            stack.extend((v, f"{p}[{i}]") for i, v in enumerate(cur))
    return None


def unpack(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any | ErrorReply:
    """msgpack bytes -> Python object, or an INVALID_REQUEST reply naming what was wrong."""
    if len(data) > max_bytes:
        return ErrorReply(
            code=ErrorCode.INVALID_REQUEST,
            message=f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes",
            field="<payload>",
        )
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
        )
    except UnicodeDecodeError as exc:
        return ErrorReply(code=ErrorCode.INVALID_REQUEST, message=f"text is not valid UTF-8: {exc.reason}",
                          field="<payload>")
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        return ErrorReply(
            code=ErrorCode.INVALID_REQUEST,
            message=f"payload is not valid msgpack ({type(exc).__name__}: {exc})"[:300],
            field="<payload>",
        )
    return obj


def _validation_reply(exc: ValidationError, request_id: str | None) -> ErrorReply:
    err = first_error(exc, root="<root>")
    message = f"{err.field}: {err.message}"[:500] + (f" (+{err.more} more)" if err.more else "")
    return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST, message=message, field=err.field)


def validate(obj: Any, model: type[M]) -> M | ErrorReply:
    """Validate a decoded object against a wire model; errors name the first bad field."""
    request_id = obj.get("request_id") if isinstance(obj, dict) else None
    if not isinstance(request_id, str) or len(request_id) > 128:
        request_id = None
    if not isinstance(obj, dict):
        return ErrorReply(code=ErrorCode.INVALID_REQUEST,
                          message=f"payload must be a map, got {type(obj).__name__}", field="<root>")
    # Typed fields refuse NaN/inf and bound their nesting through the schema; only free-form JSON
    # (tool_schemas) can hide a NaN or nest without limit, so only that subtree is walked.
    for name in FREE_FORM:
        free = obj.get(name)
        if free is None:
            continue
        if _depth(free, MAX_DEPTH) > MAX_DEPTH:
            return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST,
                              message=f"{name} nest deeper than {MAX_DEPTH} levels", field=name)
        bad = _first_non_json(free, name)
        if bad is not None:
            return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST,
                              message=f"{bad[0]}: {bad[1]}", field=bad[0])
    version = obj.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        return version_error(version, request_id)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        return _validation_reply(exc, request_id)


def decode_request(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> AssembleRequest | ErrorReply:
    obj = unpack(data, max_bytes=max_bytes)
    if isinstance(obj, ErrorReply):
        return obj
    return validate(obj, AssembleRequest)


def scan_request_id(data: bytes) -> str | None:
    """The top-level ``request_id`` of a msgpack map that will not be decoded (too large, or bad
    further on), so its refusal can still be matched to the request. Other values are skipped
    without building objects; anything unreadable gives None."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1), max_ext_len=0)
    try:
        unpacker.feed(data)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "request_id":
                rid = unpacker.unpack()
                return rid if type(rid) is str and 1 <= len(rid) <= 128 else None
            unpacker.skip()
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    return None


def peek_envelope(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope | ErrorReply:
    """Check only what the broker needs from a request, at a tenth of the cost of ``decode_request``.

    The broker routes on request_id and deadline_ns and authorizes on org_id and agent_id; these are
    checked exactly as the wire model checks them, so a request the broker accepts cannot name a
    different tenant in the worker. Everything else (model, messages, options, NaN in tool schemas)
    is validated once, by the worker, which answers INVALID_REQUEST naming the field.
    """
    obj = unpack(data, max_bytes=max_bytes)
    if isinstance(obj, ErrorReply):  # too big or not msgpack: still answer under the caller's id
        return obj.model_copy(update={"request_id": scan_request_id(data)})
    if not isinstance(obj, dict):
        return ErrorReply(code=ErrorCode.INVALID_REQUEST,
                          message=f"payload must be a map, got {type(obj).__name__}", field="<root>")
    rid = obj.get("request_id")
    request_id = rid if type(rid) is str and 1 <= len(rid) <= 128 else None

    def bad(field: str, why: str) -> ErrorReply:
        return ErrorReply(request_id=request_id, code=ErrorCode.INVALID_REQUEST, message=f"{field}: {why}",
                          field=field)

    version = obj.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION or type(version) is not int:
        return version_error(version, request_id)
    if request_id is None:
        return bad("request_id", "a string of 1 to 128 characters is required")
    for field in ("org_id", "agent_id"):
        value = obj.get(field)
        if type(value) is not str or not is_ident(value):
            return bad(field, "1 to 64 of A-Z a-z 0-9 _ . - is required")
    deadline = obj.get("deadline_ns")
    if type(deadline) is not int or deadline <= 0:
        return bad("deadline_ns", "a positive integer (Unix epoch nanoseconds) is required")
    return Envelope(request_id, obj["org_id"], obj["agent_id"], deadline)


def decode_reply(data: bytes, *, max_bytes: int = 64 << 20) -> AssembleResponse | ErrorReply:
    """Replies are either a response or an error reply; the ``code`` key tells them apart."""
    obj = unpack(data, max_bytes=max_bytes)
    if isinstance(obj, ErrorReply):
        return obj
    if isinstance(obj, dict) and "code" in obj:
        return validate(obj, ErrorReply)
    return validate(obj, AssembleResponse)
