"""The blocking client: an ``AsyncClient`` on a private event-loop thread (README "The client library").

Arguments are checked (``InvalidRequest``) before the thread starts; the client is safe to share
across threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import zmq

from ..shared.config.settings import ClientSettings
from ..shared.wire.models import AssembleRequest, AssembleResponse
from .client import AsyncClient
from .requests import ClientClosed
from .usage import summary_payload

T = TypeVar("T")
log = logging.getLogger(__name__)


class SyncClient:
    """Blocking client for threaded callers; runs an ``AsyncClient`` on a private loop thread.

    Arguments are checked (``InvalidRequest``) before the thread starts. After ``close()`` every
    call raises ``ClientClosed``; calls in flight at ``close()`` end with it too.
    """

    def __init__(self, endpoints: Sequence[str] | str | None = None, *, settings: ClientSettings | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Callable[[zmq.Socket[bytes]], None] | None = None,
                 default_timeout: float | None = None, directive_copies: bool = True) -> None:
        """The ``AsyncClient``'s arguments, named here so a wrong one names this class."""
        self._client: AsyncClient = AsyncClient(endpoints, settings=settings, ctx=ctx,
                                                configure_socket=configure_socket, default_timeout=default_timeout,
                                                directive_copies=directive_copies)
        self._lock = threading.Lock()  # orders submissions against close()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ibex-client", daemon=True)
        self._thread.start()
        self._call(self._client.start)

    def _call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the client's loop; the coroutine is created only once it will be run."""
        with self._lock:
            if self._closed:
                raise ClientClosed("client is closed: create a new client", field="client")
            fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(make(), self._loop)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise ClientClosed("client closed while the call was in flight", field="client") from None
            raise

    def assemble(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                 **fields: Any) -> AssembleResponse:
        return self._call(lambda: self._client.assemble(request, timeout=timeout, **fields))

    def assemble_or_degrade(self, request: AssembleRequest | None = None, *, timeout: float | None = None,
                            fallback_directive: str | None = None, **fields: Any) -> AssembleResponse:
        return self._call(lambda: self._client.assemble_or_degrade(
            request, timeout=timeout, fallback_directive=fallback_directive, **fields))

    def report_usage(self, assembly: AssembleResponse, *, prompt_tokens: int,
                     cached_tokens: int | None = None) -> None:
        """Fire-and-forget: never raises (bad input is logged and counted), never blocks: the report
        is handed to the client's loop thread (see ``AsyncClient.report_usage``)."""
        try:
            if self._closed:
                self._client.stats["usage_not_sent"] += 1
                log.warning("usage report not sent: the client is closed")
                return
            self._loop.call_soon_threadsafe(functools.partial(
                self._client.report_usage, assembly, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens))
        except Exception:  # the loop closed in between: still never raise
            self._client.stats["usage_not_sent"] += 1
            log.warning("usage report not sent: the client's loop is gone")

    def report_summary(self, *, org_id: str, agent_id: str, summary_key: str, text: str, covers: int,
                       as_memory: bool = False, ttl_s: int | None = None, made_at: float | None = None) -> bool:
        """Fire-and-forget (``AsyncClient.report_summary``): checked here, handed to the client's loop
        thread to send; False when bad (logged, counted) or the client is closed. Never raises."""
        fields: dict[str, Any] = {"org_id": org_id, "agent_id": agent_id, "summary_key": summary_key, "text": text,
                  "covers": covers, "as_memory": as_memory, "ttl_s": ttl_s, "made_at": made_at}
        try:
            payload, why = summary_payload(fields, time.time_ns())
            if payload is None or self._closed:
                self._client._count("summary_not_sent")
                log.warning("summary not sent: %s", why or "the client is closed")
                return False
            self._loop.call_soon_threadsafe(functools.partial(self._client.report_summary, **fields))
            return True
        except Exception:  # the loop closed in between: still never raise
            self._client._count("summary_not_sent")
            log.warning("summary not sent: the client's loop is gone")
            return False

    def status(self, endpoint: str | None = None, timeout: float = 1.0) -> dict[str, Any]:
        return self._call(lambda: self._client.status(endpoint, timeout))

    def wait_connected(self, timeout: float = 5.0, *, require_all: bool = True) -> None:
        self._call(lambda: self._client.wait_connected(timeout, require_all=require_all))

    def prepare_fallback(self) -> None:
        """Block until the fallback is loaded (see ``AsyncClient.prepare_fallback``)."""
        self._call(self._client.prepare_fallback)

    @property
    def stats(self) -> dict[str, int]:
        return self._client.stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Close the client and let every call still on the loop finish (with ``ClientClosed``)."""
        await self._client.aclose()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
