"""Admin CLI for agent directives in Redis.

    python -m memory.directive_cli set    --org acme --agent support-bot --text "Be brief."
    python -m memory.directive_cli set    --org acme --agent support-bot --file directive.txt  (- = stdin)
    python -m memory.directive_cli show   --org acme --agent support-bot
    python -m memory.directive_cli delete --org acme --agent support-bot

The Redis URL comes from ``--redis-url`` or ``IBEX_REDIS_URL``; with neither there is no Redis
to talk to (an embedded server would be empty), so the CLI says so and exits 2.
Exit codes: 0 done, 1 not found / Redis unreachable / malformed value, 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.directives import (
    DirectiveEnvelope,
    MalformedDirective,
    delete_directive,
    get_directive,
    set_directive,
)
from shared.keys import check_ident
from shared.settings import Settings


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m memory.directive_cli", description="Manage agent directives.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("set", "show", "delete"):
        p = sub.add_parser(name)
        p.add_argument("--org", required=True)
        p.add_argument("--agent", required=True)
        p.add_argument("--redis-url", default=None, help="default: $IBEX_REDIS_URL")
        if name == "set":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--text")
            src.add_argument("--file", help="read the directive from this file ('-' for stdin)")
    return ap


def _envelope_json(env: DirectiveEnvelope) -> str:
    return env.model_dump_json()


async def _run(args: argparse.Namespace, url: str) -> int:
    client = Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        if args.command == "set":
            text = args.text if args.text is not None else _read(args.file)
            env = await set_directive(client, args.org, args.agent, text)
            print(_envelope_json(env))
            return 0
        if args.command == "show":
            found = await get_directive(client, args.org, args.agent)
            if found is None:
                print(f"no directive for org={args.org} agent={args.agent}", file=sys.stderr)
                return 1
            print(_envelope_json(found))
            return 0
        existed = await delete_directive(client, args.org, args.agent)
        print(json.dumps({"deleted": existed}))
        return 0 if existed else 1
    finally:
        await client.aclose()


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    url = args.redis_url or Settings().redis_url
    if not url:
        print("error: no Redis to talk to: pass --redis-url or set IBEX_REDIS_URL", file=sys.stderr)
        return 2
    try:
        check_ident(args.org, "--org")
        check_ident(args.agent, "--agent")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, url))
    except (OSError, ValueError) as exc:  # unreadable --file, bad text
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MalformedDirective as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except (RedisConnectionError, RedisTimeoutError) as exc:
        print(f"error: cannot reach Redis at {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
