"""``python -m ibex_context.broker``: run the ZeroMQ broker in the foreground (supervisord runs it this way)."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from typing import Any

from ..shared.config.cliargs import write_port_file
from ..shared.config.settings import BrokerSettings


def _secure(settings: BrokerSettings, ctx: Any, endpoints: list[str]) -> tuple[Any, dict[str, Any]]:
    """CURVE + ZAP when a keys file is set (docs/security.md "Authentication"); otherwise refuse any endpoint
    another host could reach. Returns the running authenticator (or None) and the Broker options;
    raises AuthConfigError with a one-line reason before anything is bound."""
    from ..shared.security import auth

    if not settings.auth_keys_file:
        auth.require_auth_or_loopback(endpoints, auth_on=False)
        return None, {}
    if not settings.broker_key_file:
        raise auth.AuthConfigError("IBEX_AUTH_KEYS_FILE is set but IBEX_BROKER_KEY_FILE is not")
    from zmq.auth.thread import ThreadAuthenticator

    keyring = auth.KeyRing.load(settings.auth_keys_file)  # refuses a key in two roles
    keypair = auth.load_keypair(settings.broker_key_file)
    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback(auth.FRONT_DOMAIN, keyring)
    authenticator.configure_curve_callback(auth.BACK_DOMAIN, keyring)
    logging.getLogger(__name__).info("CURVE auth on: %d client key(s), %d worker key(s)",
                                     len(keyring.clients), len(keyring.workers))
    return authenticator, {"authorizer": keyring.authorize,
                           "configure_frontend": auth.curve_server(keypair, auth.FRONT_DOMAIN),
                           "configure_backend": auth.curve_server(keypair, auth.BACK_DOMAIN)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ibex_context.broker", description=__doc__)
    ap.add_argument("--frontend", default=None, help="bind address for clients (default IBEX_BROKER_FRONTEND)")
    ap.add_argument("--backend", default=None, help="bind address for workers (default IBEX_BROKER_BACKEND)")
    ap.add_argument("--port-file", default=None,
                    help="after binding, write the bound frontend and backend endpoints here (one a line)")
    args = ap.parse_args(argv)
    settings = BrokerSettings()
    from ..shared.config.observability import setup_logging

    setup_logging(settings.log_level, "broker", settings.log_format)
    import zmq

    from ..shared.security import auth
    from .broker import Broker

    frontend = args.frontend or settings.broker_frontend
    backend = args.backend or settings.broker_backend
    ctx = zmq.Context()
    authenticator = None
    try:
        authenticator, kw = _secure(settings, ctx, [frontend, backend])
        broker = Broker(settings=settings, frontend=frontend, backend=backend, ctx=ctx, **kw)
    except (auth.AuthConfigError, zmq.ZMQError) as exc:
        # A configuration mistake is one line and exit 2, never a traceback (supervisord shows it).
        reason = exc if isinstance(exc, auth.AuthConfigError) else f"cannot bind {frontend} / {backend}: {exc}"
        print(f"broker: {reason}", file=sys.stderr)
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)
        return 2
    if args.port_file:
        write_port_file(args.port_file, broker.frontend_endpoint, broker.backend_endpoint)
    if settings.metrics_port:
        from ..shared.config.observability import broker_registry, serve

        registry, metrics = broker_registry(lambda: broker.snapshot(orgs=False))
        broker.observe_queue_wait = metrics.queue_wait.observe
        serve(registry, settings.metrics_port)
        logging.getLogger(__name__).info("metrics on http://127.0.0.1:%d/metrics", settings.metrics_port)
    gc.collect()
    gc.freeze()  # start-up objects live forever: keep them out of every later collection
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    try:
        broker.serve_forever()
    finally:
        if authenticator is not None:
            authenticator.stop()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
