"""``python -m ibex_context.worker [--cpu N]``: one pinned uvloop worker process (run N of them per host).

Exit status 2, before anything starts, when ``IBEX_MEMORY_URL`` is not a loopback URL while
``IBEX_MEMORY_SECRET`` is the development default: the tokens it mints would be forgeable by
anyone who read the source (docs/security.md "Degradation and security").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..shared.config.settings import DEV_MEMORY_SECRET, WorkerSettings, usable_cpus
from ..shared.security.netloc import is_loopback_url
from .memservices import memory_urls

if TYPE_CHECKING:
    from .server import WorkerServer


def exposure_error(settings: WorkerSettings) -> str | None:
    """Why this worker must not talk to its memory service, or ``None`` when it may."""
    exposed = [u for u in memory_urls(settings.memory_url) if not is_loopback_url(u)]
    if settings.memory_secret == DEV_MEMORY_SECRET and exposed:
        try:  # the host only: the URL may carry credentials
            host = urlsplit(exposed[0]).hostname
        except ValueError:
            host = None
        return (f"IBEX_MEMORY_URL (host {host!r}) is not a loopback URL and IBEX_MEMORY_SECRET is the "
                "development default (it is in the source): set IBEX_MEMORY_SECRET to a private value")
    return None


def pin(cpu: int | None) -> int | None:
    """Pin this process to one CPU before any ZeroMQ context (and its I/O thread) exists."""
    if cpu is None:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    chosen = cpus[cpu % len(cpus)]
    os.sched_setaffinity(0, {chosen})
    return chosen


async def serve(settings: WorkerSettings, worker_id: str, server_cls: type[WorkerServer] | None = None) -> None:
    """Run one worker until it is drained. ``server_cls``: a ``WorkerServer`` subclass to run instead
    (the bench's transport-mode worker)."""
    import zmq

    from ..pipeline.budget.catalog import Catalog
    from .assemble import Assembler
    from .retrieve import Retriever
    from .server import WorkerServer

    if settings.redis_url is None:
        raise SystemExit("IBEX_REDIS_URL is not set; `ibex-context up` sets it (or start an embedded Redis)")
    retriever = Retriever.create(settings, settings.redis_url)
    catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries)
    catalog.warm_up()
    from ..shared.config.observability import CalibrationMetrics
    from ..shared.stores.connect import async_client
    from .calibration import Calibrator

    # Its own connection, with generous timeouts: the retriever's are sized to the request deadline.
    calibrator = Calibrator(redis=async_client(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0),
                            catalog=catalog, settings=settings, metrics=CalibrationMetrics())
    assembler = Assembler(settings=settings, catalog=catalog, retriever=retriever, worker_id=worker_id,
                          calibrator=calibrator)
    await retriever.warm_up()
    ctx = zmq.Context()
    from ..shared.security import auth

    try:
        configure = auth.curve_client_for(settings.worker_key_file, settings, role="worker")
    except auth.MissingBrokerKey as exc:
        raise SystemExit(str(exc)) from None
    from ..shared.config.observability import WorkerMetrics

    server = (server_cls or WorkerServer)(settings=settings, assembler=assembler, worker_id=worker_id, ctx=ctx,
                                          configure_socket=configure, metrics=WorkerMetrics())
    # Everything built so far (catalog, tokenizer tables, pools) lives as long as the process. A
    # full collection over it takes ~44 ms on the dev machine, longer than a whole 40 ms request;
    # frozen, later collections skip it (measured: 0.003 ms).
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    draining: set[asyncio.Task[None]] = set()

    def on_signal(sig: signal.Signals) -> None:
        logging.getLogger(__name__).info("%s: draining", sig.name)
        task = asyncio.ensure_future(server.drain())
        draining.add(task)
        task.add_done_callback(draining.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.run()
    finally:
        await calibrator.aclose()
        await retriever.aclose()
        ctx.term()


def main(argv: list[str] | None = None, *, server_cls: type[WorkerServer] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ibex_context.worker", description=__doc__)
    ap.add_argument("--cpu", type=int, default=None, help="pin to the Nth usable CPU (modulo their count)")
    ap.add_argument("--worker-id", default=None)
    args = ap.parse_args(argv)
    settings = WorkerSettings()
    refused = exposure_error(settings)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    from ..shared.config.observability import setup_logging

    setup_logging(settings.log_level, "worker", settings.log_format)
    cpus = usable_cpus()  # before pinning: afterwards the mask holds one CPU
    chosen = pin(args.cpu if settings.pin_cpus else None)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    logging.getLogger(__name__).info("worker %s pinned to cpu %s of %d", worker_id, chosen, cpus)
    import uvloop

    uvloop.run(serve(settings, worker_id, server_cls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
