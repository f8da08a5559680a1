"""The optional last frame of a worker's reply: what the broker's admission control
(``broker.admission``) learns from each answered request. Fixed layout: flags u8, loop lag µs u32."""

from __future__ import annotations

import struct
from typing import NamedTuple

_FEEDBACK = struct.Struct("<BI")
OVERLOADED_FLAG = 1


class Feedback(NamedTuple):
    """Per-reply signals for the broker's adaptive limit (``broker.admission``): a retrieval branch
    timed out or was skipped (the downstream could not keep up), and the request's wait for the
    worker's event loop in µs (the worker's CPU could not keep up)."""

    overloaded: bool
    loop_lag_us: int

    def pack(self) -> bytes:
        return _FEEDBACK.pack(OVERLOADED_FLAG if self.overloaded else 0, min(max(0, self.loop_lag_us), 2**32 - 1))

    @classmethod
    def unpack(cls, data: bytes) -> Feedback:
        if len(data) != _FEEDBACK.size:
            raise ValueError(f"feedback frame of {len(data)} bytes, expected {_FEEDBACK.size}")
        flags, lag = _FEEDBACK.unpack(data)
        return cls(bool(flags & OVERLOADED_FLAG), lag)
