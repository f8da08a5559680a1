"""The caller's deadline on a read (docs/deploy.md "Backing services").

A caller that stops waiting after some milliseconds says so in the ``Ibex-Timeout-Ms`` header:
relative, as gRPC's ``grpc-timeout``, so no clock is shared. The service turns it into a deadline
on its own monotonic clock at receipt and starts no dear stage after it: not the query embedding,
not the engine's search. Under overload, work whose caller has gone would only delay the calls
still waiting; a call refused this way is answered 504 and counted (``deadline_dropped`` in
``/healthz``). A call without the header has no deadline.
"""

from __future__ import annotations

import math
import time

from starlette.requests import Request

from .http import ApiError

NAME = "Ibex-Timeout-Ms"
HEADER = NAME.lower()  # as Starlette looks headers up
MAX_TIMEOUT_MS = 600_000.0


class DeadlinePassed(ApiError):
    """The caller's deadline passed before a stage could start."""

    def __init__(self, stage: str) -> None:
        super().__init__(504, f"the caller's deadline ({NAME}) passed before {stage}")


def deadline_of(request: Request, received: float) -> float | None:
    """The call's deadline on ``time.monotonic``'s clock (``received``: when the call arrived), or
    None without the header; a header that is not a number of milliseconds from 0 to
    ``MAX_TIMEOUT_MS`` is a 400."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw) if len(raw) <= 32 else math.nan
    except ValueError:
        ms = math.nan
    if not 0.0 <= ms <= MAX_TIMEOUT_MS:  # NaN fails too
        raise ApiError(400, f"{NAME} must be a number of milliseconds from 0 to {MAX_TIMEOUT_MS:.0f}", field=NAME)
    return received + ms / 1000.0


def check(deadline: float | None, stage: str) -> None:
    """Raise ``DeadlinePassed`` when ``deadline`` has passed: ``stage`` would start too late."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlinePassed(stage)


class Horizon:
    """The latest deadline among the calls waiting on one shared piece of work (the hot and the
    search call of one assembly share the question's embedding): it may be dropped only when
    every one of them has gone. ``None``: someone waits without a deadline."""

    __slots__ = ("at",)

    def __init__(self, deadline: float | None) -> None:
        self.at = deadline

    def extend(self, deadline: float | None) -> None:
        if self.at is not None:
            self.at = None if deadline is None else max(self.at, deadline)

    def passed(self, now: float) -> bool:
        return self.at is not None and now >= self.at
