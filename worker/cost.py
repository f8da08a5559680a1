"""What a request will cost the worker's loop, known before any work on it.

A request's CPU cost grows with its maps and arrays (messages, content parts, tool calls, schemas:
each is validated, counted and laid out) and with the base64 images read for their size. Both are
bounded before the work that grows with them:

* ``decode`` counts maps and arrays while the payload is unpacked and stops at
  ``IBEX_MAX_REQUEST_ITEMS``: a request over it is refused INVALID_REQUEST naming the top-level
  field that holds them, before the codec walks or the pipeline counts any of it;
* ``stub_images`` reads each base64 image a raw-protocol caller sent (the client library sends
  stubs) once, on receipt, and puts its stub in its place (``pipeline.counting.images``), so budget and
  formatting read the size from the stub and never walk the bytes again.

``Cost`` is what the fair scheduler (``worker.fair``) charges a request before its stages run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ..pipeline.counting.images import stub_messages
from ..shared.wire.codec import decode_request, validate
from ..shared.wire.errors import ErrorCode
from ..shared.wire.models import AssembleRequest, ErrorReply

ITEMS_SETTING = "IBEX_MAX_REQUEST_ITEMS"


class TooManyItems(Exception):
    """Raised from the unpacker's hooks: the payload holds more maps and arrays than allowed."""


@dataclass(slots=True)
class _Counter:
    """The unpacker's hooks: every map and array built is counted against ``limit`` under the
    top-level field being read."""

    limit: int
    total: int = 0
    field: str = "<payload>"
    request_id: Any = None  # once read: the refusal names the caller's request

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._one()
        return value

    def list(self, value: list[Any]) -> list[Any]:
        self._one()
        return value

    def _one(self) -> None:
        self.total += 1
        if self.total > self.limit:
            raise TooManyItems(self.field)


@dataclass(frozen=True, slots=True)
class Cost:
    """A decoded request's size in the units its CPU stages grow with."""

    items: int
    payload_bytes: int


def decode(data: bytes, *, max_bytes: int, max_items: int) -> tuple[AssembleRequest | ErrorReply, Cost]:
    """``codec.decode_request`` with the maps and arrays counted while they are unpacked: over
    ``max_items`` the request is refused before anything else is done with it. Whatever else is
    wrong with the payload is answered in the codec's own words."""
    cost = Cost(0, len(data))
    if len(data) > max_bytes:
        return decode_request(data, max_bytes=max_bytes), cost
    counter = _Counter(max_items)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_ext_len=0, max_buffer_size=max(1, len(data)),
                                object_hook=counter.map, list_hook=counter.list)
    unpacker.feed(data)
    try:
        obj = _read_root(unpacker, counter)
        if unpacker.tell() != len(data):
            raise ValueError("extra data after the payload")
    except TooManyItems as exc:
        return too_many(str(exc), max_items, counter.request_id), Cost(counter.total, len(data))
    except Exception:  # garbage of any kind: within the item limit, so the codec's pass is bounded too
        return decode_request(data, max_bytes=max_bytes), cost
    return validate(obj, AssembleRequest), Cost(counter.total, len(data))


def _read_root(unpacker: msgpack.Unpacker, counter: _Counter) -> Any:
    """The root map one field at a time, so the count knows which field it is in."""
    try:
        n = unpacker.read_map_header()
    except ValueError:  # not a map: read whole (and counted), for the codec to refuse
        return unpacker.unpack()
    counter.total += 1
    obj: dict[str, Any] = {}
    for _ in range(n):
        key = unpacker.unpack()
        if not isinstance(key, str):
            raise ValueError("map keys must be strings")
        counter.field = key
        obj[key] = unpacker.unpack()
        if key == "request_id":
            counter.request_id = obj[key]
    return obj


def too_many(field: str, limit: int, request_id: object = None) -> ErrorReply:
    """The refusal of a request over the item limit, naming the field and the limit."""
    rid = request_id if isinstance(request_id, str) and len(request_id) <= 128 else None
    return ErrorReply(
        request_id=rid, code=ErrorCode.INVALID_REQUEST, field=field,
        message=f"{field}: the request holds more than {limit} maps and arrays (messages, content parts, tool "
                f"calls, schemas), the limit of one request ({ITEMS_SETTING}): send fewer in {field}")


def stub_images(req: AssembleRequest) -> AssembleRequest:
    """The request with each base64 image of its conversation as its stub (read once, here)."""
    if req.format is None or not req.messages:
        return req
    messages = stub_messages(req.messages)
    return req if messages is req.messages else req.model_copy(update={"messages": messages})
