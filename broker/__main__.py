"""``python -m broker``: run the ZeroMQ broker in the foreground (supervisord runs it this way)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from shared.settings import Settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker", description=__doc__)
    ap.add_argument("--frontend", default=None, help="bind address for clients (default IBEX_BROKER_FRONTEND)")
    ap.add_argument("--backend", default=None, help="bind address for workers (default IBEX_BROKER_BACKEND)")
    args = ap.parse_args(argv)
    settings = Settings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s broker[%(process)d] %(name)s: %(message)s")
    from broker.broker import Broker

    broker = Broker(settings=settings, frontend=args.frontend, backend=args.backend)
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    broker.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
