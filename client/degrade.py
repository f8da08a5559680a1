"""The client's degraded response: history-only (or directive + history) context built locally.

``assemble_or_degrade`` never raises for service faults (README "The client library"): it answers
with what the pure pipeline (``pipeline.assemble``, the one the worker runs) makes of no
memories, with the reason recorded. Only the pure pipeline is imported, so a proxy that imports
the client never loads aiohttp, redis or the worker (tests/test_client_imports.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading

from ibex_context.pipeline.assemble import Policy, assemble
from ibex_context.pipeline.hits import failed_result
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import IbexError
from ibex_context.shared.models import AssembleRequest, AssembleResponse, BranchOutcome
from ibex_context.shared.settings import Settings

log = logging.getLogger(__name__)

# Modules the degraded response runs; ``load_fallback`` imports them off the event loop (numpy and
# the packer take a noticeable part of the ~1 s a cold fallback would stall the loop).
FALLBACK_MODULES = ("ibex_context.pipeline.assemble",)


def load_fallback(settings: Settings) -> Catalog | Exception:
    """Load what ``degraded_response`` needs (on a thread, from ``AsyncClient.start()``).

    A failure is returned, not raised, so it reaches the first fallback instead of an
    unretrieved-exception warning.
    """
    try:
        for name in FALLBACK_MODULES:
            importlib.import_module(name)
        catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries,
                               slow_vocabularies=False)
        catalog.warm_up()
        return catalog
    except Exception as exc:
        log.warning("the client's fallback could not load: %s", exc)
        return exc


def load_fallback_in_background(loop: asyncio.AbstractEventLoop,
                                settings: Settings) -> asyncio.Future[Catalog | Exception]:
    """``load_fallback`` on a daemon thread, its result delivered to ``loop`` as a future.

    Not the loop's default executor: ``asyncio.run`` waits for that executor's threads when it
    ends, so a short-lived caller (a CLI call to a stopped broker) would wait ~1 s for a fallback
    it never uses; and a daemon thread does not hold up the interpreter's exit either.
    """
    future: asyncio.Future[Catalog | Exception] = loop.create_future()

    def deliver(result: Catalog | Exception) -> None:
        if not future.done():
            future.set_result(result)

    def work() -> None:
        result = load_fallback(settings)
        try:
            loop.call_soon_threadsafe(deliver, result)
        except RuntimeError:  # the loop closed first: nobody is waiting
            pass

    threading.Thread(target=work, name="ibex-fallback-load", daemon=True).start()
    return future


def degraded_response(req: AssembleRequest, exc: IbexError, fallback_directive: str | None = None,
                      *, catalog: Catalog | None = None, settings: Settings | None = None) -> AssembleResponse:
    """History-only (or directive + history) context built locally by the pure pipeline; every
    branch is recorded as failed with ``exc``'s code."""
    failed = BranchOutcome(status="error", elapsed_ms=0.0, error_class=exc.code.value, detail=exc.message[:200])
    resp = assemble(req, failed_result(fallback_directive, failed), catalog=catalog or Catalog.load(),
                    policy=Policy.from_settings(settings or Settings()))
    reason = f"context service {exc.code.value}: {exc.message}"
    return resp.model_copy(update={"degraded": True, "degraded_reasons": [reason, *resp.degraded_reasons]})
