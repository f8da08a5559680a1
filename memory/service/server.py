"""Run the reference memory service under uvicorn.

    python -m ibex_context.memory.service.server [--host H] [--port N] [--port-file F] [--redis-url URL]
        [--enable-faults]

``--port 0`` binds a free port; the bound port is logged and, with ``--port-file``, written to
that file (atomically, once the socket listens) so a supervisor or test can find it. Without
``--redis-url`` or ``IBEX_REDIS_URL`` an embedded redis-server is started for the process's
lifetime (empty: seed it with ``python -m ibex_context.memory.service.seed``). The token secret is read from
``IBEX_MEMORY_SECRET`` only, never from the command line (it would show in ``ps``).
Exit status 2 for a bad configuration, e.g. ``IBEX_MEMORY_RELEVANCE_FLOOR`` >= 0.5, a host other
than loopback (``--host`` / ``IBEX_MEMORY_HOST``) while the secret is the development default
(anyone who read the source could mint a token for any org), or ``--enable-faults`` on a host
other than loopback (docs/security.md "Degradation and security").
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError
from threadpoolctl import threadpool_limits

from ...shared.config.cliargs import write_port_file
from ...shared.config.observability import setup_logging
from ...shared.config.settings import env_name
from ...shared.security.netloc import is_loopback_host
from ..embedded_redis.server import EmbeddedRedis, RedisStartError, resolve_redis_url
from ..embedders.embed import EMBEDDERS, Embedder, EmbedderUnavailable, load_embedder
from ..embedders.errors import EmbeddingFailed
from .app import create_app
from .config import MemoryConfig
from .faults import TrackingH11Protocol, TrackingHttpToolsProtocol

log = logging.getLogger(__name__)


def _parser(settings: MemoryConfig) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ibex_context.memory.service.server",
                                 description="Reference memory service.")
    ap.add_argument("--host", default=settings.memory_host)
    ap.add_argument("--port", type=int, default=settings.memory_port, help="0 picks a free port")
    ap.add_argument("--port-file", default=None, help="write the bound port to this file")
    ap.add_argument("--redis-url", default=None, help="default: $IBEX_REDIS_URL, else an embedded server")
    ap.add_argument("--enable-faults", action="store_true", help="expose PUT/DELETE /_faults")
    ap.add_argument("--embedder", choices=list(EMBEDDERS), default=None, help="default: $IBEX_MEMORY_EMBEDDER")
    ap.add_argument("--relevance-floor", type=float, default=None, help="default: $IBEX_MEMORY_RELEVANCE_FLOOR")
    ap.add_argument("--http", choices=["httptools", "h11"], default="httptools",
                    help="HTTP parser: httptools (C, default) or h11 (pure Python)")
    ap.add_argument("--log-level", default=settings.log_level)
    return ap


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (we bind it ourselves so port 0 can be reported before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def exposure_error(host: str, config: MemoryConfig, *, enable_faults: bool) -> str | None:
    """Why this service must not listen on ``host``, or ``None`` when it may.

    Off loopback, the development secret would let anyone mint a token for any org, and
    ``/_faults`` (which needs no token) would let anyone break the service.
    """
    if is_loopback_host(host):
        return None
    if config.uses_dev_secret:
        return (f"refusing to listen on {host!r} with the development IBEX_MEMORY_SECRET (it is in the "
                "source): set IBEX_MEMORY_SECRET to a private value, or bind 127.0.0.1")
    if enable_faults:
        return f"refusing --enable-faults on {host!r}: fault injection is for loopback hosts only"
    return None


def _embedder(config: MemoryConfig) -> Embedder | None:
    """The configured embedder, or None after one line on stderr; a remote endpoint must answer
    (and say its dimension) before the service serves."""
    try:
        embedder = load_embedder(config.embedder, config.embedder_config())
        probe = getattr(embedder, "load", None) if config.embedder == "openai" else None
        if callable(probe):
            probe()
    except (EmbedderUnavailable, EmbeddingFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    return embedder


def _config(**overrides: Any) -> MemoryConfig | None:
    """The memory service's settings (the environment, ``overrides`` on top), or None after a line
    on stderr for each bad value, naming its variable."""
    try:
        return MemoryConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            where = f"{env_name(MemoryConfig, str(err['loc'][0]))}: " if err["loc"] else ""
            print(f"error: {where}{err['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    settings = _config()
    if settings is None:
        return 2
    args = _parser(settings).parse_args(argv)
    # The same log setup as broker and workers, so IBEX_LOG_FORMAT=json holds here too (docs/deploy.md "Observability").
    setup_logging(args.log_level.upper(), "memory", settings.log_format)
    config = _config(redis_url=args.redis_url, embedder=args.embedder, relevance_floor=args.relevance_floor)
    if config is None:
        return 2
    refused = exposure_error(args.host, config, enable_faults=args.enable_faults)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    # One BLAS thread: requests already run side by side, and OpenBLAS threads spinning on a busy
    # machine made one MiniLM query cost 430 ms of wall instead of 13 ms (docs/selection-quality.md).
    threadpool_limits(limits=1, user_api="blas")
    embedder = _embedder(config)
    if embedder is None:
        return 2
    embedded: EmbeddedRedis | None = None
    try:
        url, embedded = resolve_redis_url(config.redis_url)
    except RedisStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app = create_app(config.model_copy(update={"redis_url": url}), enable_faults=args.enable_faults,
                     embedder=embedder)
    try:
        try:
            sock = bind_socket(args.host, args.port)
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        port = int(sock.getsockname()[1])
        if args.port_file:
            write_port_file(args.port_file, port)
        log.info("memory service on http://%s:%d (redis %s%s, embedder %s, faults %s)", args.host, port,
                 url, " embedded" if embedded else "", config.embedder, "on" if args.enable_faults else "off")
        protocol = TrackingH11Protocol if args.http == "h11" else TrackingHttpToolsProtocol
        # log_config=None: uvicorn's loggers propagate to the one handler setup_logging installed.
        uv_config = uvicorn.Config(
            # proxy_headers off: nothing fronts this service, and a caller on 127.0.0.1 (trusted by
            # default) could otherwise set its own client address with X-Forwarded-For.
            app, http=protocol, loop="uvloop", ws="none", lifespan="on", access_log=False, proxy_headers=False,
            log_level=args.log_level.lower(), log_config=None, timeout_graceful_shutdown=3,
        )
        uvicorn.Server(uv_config).run(sockets=[sock])
        return 0
    finally:
        if embedded is not None:
            embedded.close()


if __name__ == "__main__":
    sys.exit(main())
