"""``ibex-context cluster add-shard | move-slots``: grow a Redis Cluster with the memory indexes in
place before any key moves (``ops.reshard``; docs/memory-search.md "Shards").

    ibex-context cluster add-shard --node HOST:PORT [--slot-count N]
    ibex-context cluster move-slots --to NODE --slots A-B[,C-D] [--from NODE]

The cluster comes from ``--url``, else ``IBEX_REDIS_URL``, else the running stack's Redis (as for
``ibex-context directive``). Progress goes to stderr about once a second, the summary to stdout.
Interrupted (Ctrl-C, a node restart), the same command run again continues where it stopped.
Exit codes: 0 done, 1 the cluster failed or does not answer, 2 a usage error; every mistake is
one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

import redis
from pydantic import ValidationError

from ..memory.embedded_redis.server import default_redis_url
from ..shared.config.cliargs import CliParser, settings_error, utf8_arg
from .reshard import Cluster, ReshardError, add_shard, connect, move_slots, parse_slots

PROG = "ibex-context cluster"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, type=utf8_arg,
                   help="the cluster, by any node: redis+cluster://HOST:PORT (default: $IBEX_REDIS_URL, "
                        "else the running stack's Redis)")
    p.add_argument("--batch", type=_positive, default=100, help="keys per MIGRATE (default: 100)")
    p.add_argument("--migrate-timeout-ms", type=_positive, default=10_000,
                   help="how long one MIGRATE may take (default: 10000)")


def build_parser(prog: str = PROG) -> CliParser:
    ap = CliParser(prog=prog, description="Add a shard to a Redis Cluster or move slots between its primaries, "
                                          "each slot's memory indexes created on the target first.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{add-shard,move-slots}")
    a = sub.add_parser("add-shard", help="join an empty node and move it an even share of the slots",
                       description="Join an empty, cluster-enabled node with the query engine to the cluster "
                                   "(CLUSTER MEET) and move it an even share of the slots.")
    a.add_argument("--node", required=True, type=utf8_arg, help="the new node, HOST:PORT")
    a.add_argument("--slot-count", type=int, default=None, metavar="N",
                   help="slots the new node should hold (default: 16384 / primaries after it joins)")
    _common(a)
    m = sub.add_parser("move-slots", help="move slots to a primary of the cluster",
                       description="Move slots to a primary of the cluster, from whichever primary serves each.")
    m.add_argument("--to", required=True, type=utf8_arg, help="the target primary: HOST:PORT or node id")
    m.add_argument("--slots", required=True, type=utf8_arg, help="slots: A-B, or a list like 5,7-9")
    m.add_argument("--from", dest="source", default=None, type=utf8_arg,
                   help="the primary every slot must come from (a check): HOST:PORT or node id")
    _common(m)
    return ap


def _run(args: argparse.Namespace, cluster: Cluster) -> str:
    if args.command == "add-shard":
        report = add_shard(cluster, args.node, count=args.slot_count, batch=args.batch,
                           migrate_timeout_ms=args.migrate_timeout_ms)
    else:
        slots = parse_slots(args.slots)
        source = cluster.find(args.source) if args.source else None
        report = move_slots(cluster, slots, cluster.find(args.to), source=source, batch=args.batch,
                            migrate_timeout_ms=args.migrate_timeout_ms)
    return report.line()


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    prog = f"{prog} {args.command}"
    try:
        url, source = default_redis_url(args.url)
        source = "--url" if args.url else source
    except ValidationError as exc:  # a malformed IBEX_* variable
        return _fail(prog, settings_error(exc), 2)
    if not url:
        return _fail(prog, "no cluster to talk to: pass --url redis+cluster://HOST:PORT or set IBEX_REDIS_URL", 2)
    try:
        if args.command == "move-slots":
            parse_slots(args.slots)  # a bad range is refused before anything is asked of the cluster
        cluster = connect(url)
        try:
            print(_run(args, cluster))
        finally:
            cluster.close()
    except ReshardError as exc:
        where = "" if exc.usage else f" ({url}, {source})"
        return _fail(prog, f"{exc}{where}", 2 if exc.usage else 1)
    except redis.RedisError as exc:  # a node failed part way
        return _fail(prog, f"{exc} ({url}); rerun the same command to continue", 1)
    return 0


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
