"""Admin CLI for agent directives in Redis (``ibex-context directive``).

    ibex-context directive set    --org acme --agent support-bot --text "Be brief."
    ibex-context directive set    --org acme --agent support-bot --file directive.txt  (- = stdin)
    ibex-context directive show   --org acme --agent support-bot
    ibex-context directive delete --org acme --agent support-bot

``python -m ibex_context.memory.store.directive_cli`` is the same tool. The Redis URL comes from ``--redis-url``, else
``IBEX_REDIS_URL``, else the one ``make up`` recorded in ``.run/`` for the running stack (README
"Quickstart"); with none of them there is no Redis to talk to (an embedded server would be empty),
so the CLI says so and exits 2. Every mistake is one line on stderr, ``PROG: what is wrong``.
Exit codes: 0 done, 1 not found / Redis unreachable / malformed value, 2 usage error.

``CliParser`` and ``utf8_arg`` are shared by the other admin CLIs (``memory.service.seed``, ``client.cli``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...shared.config.cliargs import CliParser, settings_error, utf8_arg
from ...shared.stores.connect import REDIS_ERRORS, async_client
from ...shared.stores.directives import (
    MAX_DIRECTIVE_CHARS,
    DirectiveEnvelope,
    MalformedDirective,
    delete_directive,
    get_directive,
    set_directive,
)
from ...shared.stores.keys import check_ident
from ..embedded_redis.server import default_redis_url

PROG = "python -m ibex_context.memory.store.directive_cli"
REDIS_TIMEOUT_S = 5.0  # connect and per-command; an admin tool may wait longer than a request


class UsageError(ValueError):
    """A caller mistake found after parsing; the message names the argument."""


def build_parser(prog: str = PROG) -> CliParser:
    ap = CliParser(prog=prog, description="Set, show or delete an agent's directive in Redis.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{set,show,delete}")
    helps = {"set": "store a directive (the version goes up by one)", "show": "print the stored envelope",
             "delete": "remove the directive (exit 1 if there was none)"}
    for name in ("set", "show", "delete"):
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        p.add_argument("--org", required=True, type=utf8_arg, help="org id (letters, digits, _ . -)")
        p.add_argument("--agent", required=True, type=utf8_arg, help="agent id (letters, digits, _ . -)")
        p.add_argument("--redis-url", default=None, type=utf8_arg,
                       help="default: $IBEX_REDIS_URL, else the running stack's Redis (.run/redis-url)")
        if name == "set":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--text", type=utf8_arg, help="the directive text (not empty)")
            src.add_argument("--file", help="read the directive from this file ('-' for stdin)")
    return ap


def _envelope_json(env: DirectiveEnvelope) -> str:
    return env.model_dump_json()


def directive_text(args: argparse.Namespace) -> str:
    """The text to store, checked here so every refusal names ``--text`` or ``--file``."""
    where = "--text" if args.text is not None else f"--file {args.file}"
    try:
        text: str = args.text if args.text is not None else _read(args.file)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not valid UTF-8 (byte {exc.start})") from exc
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or exc}") from exc
    if not text.strip():
        raise UsageError(f"{where}: a directive cannot be empty or only whitespace "
                         "(use `delete` to remove one)")
    if len(text) > MAX_DIRECTIVE_CHARS:
        raise UsageError(f"{where}: {len(text)} characters, at most {MAX_DIRECTIVE_CHARS} allowed")
    return text


async def _run(args: argparse.Namespace, url: str, prog: str, text: str) -> int:
    client = async_client(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        if args.command == "set":
            env = await set_directive(client, args.org, args.agent, text)
            print(_envelope_json(env))
            return 0
        if args.command == "show":
            found = await get_directive(client, args.org, args.agent)
            if found is None:
                print(f"{prog}: no directive for org={args.org} agent={args.agent}", file=sys.stderr)
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
        return sys.stdin.buffer.read().decode("utf-8")
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    """Run one command; ``prog`` is how the tool names itself (``ibex-context directive`` via the CLI)."""
    args = build_parser(prog).parse_args(argv)
    prog = f"{prog} {args.command}"
    try:
        check_ident(args.org, "--org")
        check_ident(args.agent, "--agent")
        text = directive_text(args) if args.command == "set" else ""
        url, source = default_redis_url(args.redis_url)
    except ValidationError as exc:  # a malformed IBEX_* variable (before ValueError: a subclass)
        return _fail(prog, settings_error(exc), 2)
    except ValueError as exc:  # UsageError, a bad --org / --agent
        return _fail(prog, str(exc), 2)
    if not url:
        return _fail(prog, "no Redis to talk to: pass --redis-url, set IBEX_REDIS_URL, "
                           "or start the stack with `make up`", 2)
    try:
        return asyncio.run(_run(args, url, prog, text))
    except MalformedDirective as exc:
        return _fail(prog, exc.message, 1)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        return _fail(prog, f"cannot reach Redis at {url} ({source}): {exc}", 1)
    except REDIS_ERRORS as exc:
        return _fail(prog, f"Redis at {url} ({source}): {exc}", 1)
    except ValueError as exc:  # an unparseable Redis URL
        return _fail(prog, f"Redis URL {url!r} ({source}): {exc}", 2)


if __name__ == "__main__":
    sys.exit(main())
