"""``ibex-context calibration show --org O [--model M] [--json]``: the learned token-count ratios.

Reads the (org, model) sketches the workers write from usage reports (docs/assembly.md "Calibrated token
counts") and prints, per model, the effective sample count, the ratio provider count / service
count at the median, at the configured quantile and at the largest bucket seen, whether budgets
use it yet (``IBEX_CALIBRATION_MIN_SAMPLES``), the multiplier they charge and the refused reports.

The Redis URL comes from ``--redis-url``, else ``IBEX_REDIS_URL``, else the running stack's (as for
``ibex-context directive``). Exit codes: 0 shown, 1 nothing learned yet / Redis unreachable,
2 usage error; every mistake is one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pydantic import ValidationError

from ..memory.embedded_redis.server import default_redis_url
from ..pipeline.budget.catalog import Catalog
from ..pipeline.budget.usable import multiplier
from ..pipeline.counting.calibration import Calibration
from ..shared.config.cliargs import CliParser, settings_error, utf8_arg
from ..shared.config.settings import WorkerSettings
from ..shared.stores.connect import REDIS_ERRORS, async_client
from ..shared.stores.keys import check_ident
from ..shared.wire.errors import UnknownModel
from ..worker import calibration_store as store

PROG = "ibex-context calibration"
REDIS_TIMEOUT_S = 5.0


def build_parser(prog: str = PROG) -> CliParser:
    ap = CliParser(prog=prog, description="Show the token-count calibration learned from usage reports.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{show}")
    p = sub.add_parser("show", help="print the learned ratio and quantiles of an org's models",
                       description="Print the learned ratio and quantiles of an org's models.")
    p.add_argument("--org", required=True, type=utf8_arg, help="org id (letters, digits, _ . -)")
    p.add_argument("--model", default=None, type=utf8_arg, help="one model (any name the catalog resolves); "
                                                                "default: every model the org has reported for")
    p.add_argument("--redis-url", default=None, type=utf8_arg,
                   help="default: $IBEX_REDIS_URL, else the running stack's Redis (.run/redis-url)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return ap


def describe(model: str, cal: Calibration, catalog: Catalog, settings: WorkerSettings) -> dict[str, Any]:
    """One model's row: the sketch and what the budget makes of it."""
    spec = catalog.model(model)
    mult = multiplier(spec, cal)
    used = settings.calibration and cal.active(settings.calibration_min_samples)
    return {"model": model, "family": spec.family.name, "rule": "calibrated" if used else spec.family.estimate_kind,
            "samples": round(cal.samples, 1), "min_samples": settings.calibration_min_samples,
            "ratio_p50": round(cal.median, 4), f"ratio_p{cal.quantile * 100:g}": round(cal.ratio, 4),
            "ratio_max": round(cal.top, 4), "multiplier": round(mult, 4) if used else None,
            "effective_factor": round(mult * spec.family.estimate_factor, 4) if used else None,
            "safety_buffer_fraction": round(cal.safety_fraction(spec.family.safety_buffer_fraction), 4)
            if used else spec.family.safety_buffer_fraction,
            "accepted": cal.accepted, "refused": cal.refused}


async def _collect(args: argparse.Namespace, url: str, catalog: Catalog,
                   settings: WorkerSettings) -> list[dict[str, Any]]:
    client = async_client(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        models = [catalog.model(args.model).name] if args.model else await store.models_of(client, args.org)
        rows = []
        for model in models:
            cal = await store.read(client, args.org, model, quantile=settings.calibration_quantile)
            if cal is not None:
                rows.append(describe(model, cal, catalog, settings))
        return rows
    finally:
        await client.aclose()


def _print(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        q = next(k for k in r if k.startswith("ratio_p") and k != "ratio_p50")
        print(f"{r['model']} ({r['family']}): rule {r['rule']}, {r['samples']} samples (min {r['min_samples']}), "
              f"ratio p50 {r['ratio_p50']} {q.removeprefix('ratio_')} {r[q]} max {r['ratio_max']}, "
              f"multiplier {r['multiplier'] if r['multiplier'] is not None else '-'}, "
              f"safety {r['safety_buffer_fraction']:.1%}, reports {r['accepted']} accepted / {r['refused']} refused")


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    prog = f"{prog} {args.command}"
    try:
        check_ident(args.org, "--org")
        settings = WorkerSettings()
        catalog = Catalog.load(settings.catalog_path)
        if args.model:
            catalog.model(args.model)
        url, source = default_redis_url(args.redis_url)
    except UnknownModel as exc:
        return _fail(prog, f"--model: {exc.message}", 2)
    except ValidationError as exc:  # a malformed IBEX_* variable (before ValueError: a subclass)
        return _fail(prog, settings_error(exc), 2)
    except ValueError as exc:  # a bad --org, an unreadable catalog
        return _fail(prog, str(exc), 2)
    if not url:
        return _fail(prog, "no Redis to talk to: pass --redis-url, set IBEX_REDIS_URL, "
                           "or start the stack with `make up`", 2)
    try:
        rows = asyncio.run(_collect(args, url, catalog, settings))
    except REDIS_ERRORS as exc:
        return _fail(prog, f"Redis at {url} ({source}): {exc}", 1)
    except ValueError as exc:  # an unparseable Redis URL
        return _fail(prog, f"Redis URL {url!r} ({source}): {exc}", 2)
    if not rows:
        what = f"model {args.model}" if args.model else "any model"
        return _fail(prog, f"no usage reports for org {args.org} and {what} yet", 1)
    if args.json:
        print(json.dumps({"org_id": args.org, "models": rows}, indent=2))
    else:
        _print(rows)
    return 0


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
