"""Several memory services behind one worker: calls spread over them, and a call that cannot
reach one goes to the next, inside the caller's deadline.

``IBEX_MEMORY_URL`` may list several base URLs, comma-separated (every memory service of the
deployment, all on the same Redis). Calls take the services in turn (round robin). A call whose
service cannot be reached (refused, unreachable, or the connection closed before any byte of an
answer) is sent to the next service at once; the failed one is tried last for ``COOL_S``, so
later calls do not pay for it. An answer, any status, is the answer: a 503 from a service whose
Redis is down is the same on every service. Timeouts stay the caller's: one ``asyncio.timeout``
around ``call`` bounds every try together (the branch's own deadline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .memhttp import ConnectError, MemoryHTTP, ServerDisconnectedError

COOL_S = 2.0  # a service that could not be reached is tried after the others for this long


def memory_urls(setting: str) -> list[str]:
    """The base URLs an ``IBEX_MEMORY_URL`` value names (one, or several comma-separated)."""
    urls = [u.strip() for u in setting.split(",") if u.strip()]
    return list(dict.fromkeys(urls)) or [setting]


class MemoryServices:
    """A keep-alive pool per memory service (``worker.memhttp``), called in turn, failing over."""

    def __init__(self, urls: Sequence[str], *, max_body: int, max_idle: int,
                 user_agent: str = "ibex-context-worker") -> None:
        if not urls:
            raise ValueError("no memory service URL")
        self.services = [MemoryHTTP(u, max_body=max_body, max_idle=max_idle, user_agent=user_agent) for u in urls]
        self.failovers = 0  # calls sent on to another service because one could not be reached
        self._turn = 0
        self._down_until = [0.0] * len(self.services)

    @property
    def base_url(self) -> str:
        return ", ".join(s.base_url for s in self.services)

    def _order(self) -> list[int]:
        """This call's services: the next in turn first, those that failed lately last."""
        n = len(self.services)
        start, self._turn = self._turn, (self._turn + 1) % n
        turn = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        return sorted(turn, key=lambda i: self._down_until[i] > now)

    async def call(self, method: str, path: str, headers: bytes, *, params: dict[str, str] | None = None,
                   body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body) from the first service that answers; the last connection error if none."""
        last: ConnectionError | None = None
        for i in self._order():
            service = self.services[i]
            if last is not None:
                self.failovers += 1
            try:
                return await service.request(service.request_bytes(method, path, headers, params=params, body=body))
            except (ConnectError, ServerDisconnectedError) as exc:
                self._down_until[i] = time.monotonic() + COOL_S
                last = exc
        assert last is not None
        raise last

    def close(self) -> None:
        for service in self.services:
            service.close()
