"""``ibex-context assemble``: one assembly through the running broker, from options or a request file.

Every caller mistake is one line naming the option or the file's field (exit 2); a service fault is
one line (exit 1). A request file is the wire's ``AssembleRequest`` as JSON, in either form (docs/assembly.md
"Chat-native assembly"), so a proxy engineer can replay the conversation they hold.
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

from ..shared.config.cliargs import utf8_arg

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


def assemble_parser(sub: Any) -> None:
    p = sub.add_parser("assemble", help="assemble context through the running broker",
                       description="Assemble context for one request through the running broker "
                                   "(make up) and print it.")
    p.add_argument("--request", default=None, metavar="FILE",
                   help="an AssembleRequest as JSON, either form (e.g. format openai|anthropic with the "
                        "proxy's messages, system, tools); the options below override its fields (default: none)")
    p.add_argument("--org", default=None, type=utf8_arg,
                   help="org id (letters, digits, _ . -; default: the request file's; required without one)")
    p.add_argument("--agent", default=None, type=utf8_arg,
                   help="agent id (letters, digits, _ . -; default: the request file's; required without one)")
    p.add_argument("--model", default=None, type=utf8_arg,
                   help=f"model name from the capability catalog (default: the request file's, else {DEFAULT_MODEL})")
    p.add_argument("--query", default=None, type=utf8_arg,
                   help="what the user asked; searched against memories (at most 100000 characters; "
                        "default: the request file's; required without one)")
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
    p.add_argument("--explain", action="store_true",
                   help="print this live assembly as `explain` does: the budget and every candidate's decision "
                        "with its reason and score (default: the readable summary)")
    p.add_argument("--full", action="store_true",
                   help=f"in the readable summary, print every line whole (default: lines cut at "
                        f"{CUT_CHARS} characters, at most {MAX_LINES} lines of rendered context)")


CUT_CHARS = 150  # the readable summary's line width, unless --full
MAX_LINES = 40  # lines of rendered context shown, unless --full


def _cut(line: str, full: bool, cut: list[int]) -> str:
    if full or len(line) <= CUT_CHARS:
        return line
    cut[0] += 1
    return line[: CUT_CHARS - 3] + "..."


def _cut_note(cut: int, hidden: int) -> None:
    if cut or hidden:
        what = [f"{cut} line(s) cut at {CUT_CHARS} characters"] if cut else []
        what += [f"{hidden} more line(s) not shown"] if hidden else []
        print(f"  ({', '.join(what)}: --full prints every line whole, --json the whole response)")


def print_response(resp: Any, full: bool = False) -> None:
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
    if resp.summary is not None:
        from .explain import summary_line

        print(f"  {summary_line(resp)}")
    if resp.format is not None:
        _print_prompt(resp, full)
        return
    print("  --- rendered context ---")
    lines = resp.rendered.splitlines()
    shown = lines if full else lines[:MAX_LINES]
    cut = [0]
    for line in shown:
        print("  | " + _cut(line, full, cut))
    _cut_note(cut[0], len(lines) - len(shown))


def _print_prompt(resp: Any, full: bool = False) -> None:
    """A chat assembly: what the proxy sends to the provider, one line per message (or block)."""
    print(f"  --- prompt ({resp.format}): {len(resp.messages or [])} messages, {resp.prompt_tokens} tokens "
          f"({resp.prompt_tokens_kind}), stable prefix {resp.stable_prefix_tokens}, "
          f"history left out {len(resp.history)} ---")
    items = [("system", b) for b in resp.system or []] + [(m.get("role", "?"), m) for m in resp.messages or []]
    cut = [0]
    for role, item in items:
        content = item.get("content", item.get("text")) if isinstance(item, dict) else item
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        if isinstance(item, dict) and item.get("tool_calls"):
            text = f"{text or ''} tool_calls={json.dumps(item['tool_calls'], ensure_ascii=False)}"
        line = str(text) if full else " ".join(str(text).split())
        print(f"  | {role:<9} " + _cut(line, full, cut))
    _cut_note(cut[0], 0)


def _field_error(exc: Any) -> str:
    """The first pydantic error as ``--option: what is wrong`` (a ValidationError names model fields)."""
    from ..shared.wire.validation import first_error

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

    from ..shared.wire.models import AssembleRequest
    from ..shared.wire.validation import first_error

    doc = _request_file(args.request) if args.request else {}
    missing = [(opt, field) for opt, field in (("--org", "org_id"), ("--agent", "agent_id"), ("--query", "query"))
               if getattr(args, opt[2:]) is None and field not in doc]
    if missing and args.request:
        raise CliError(f"--request {args.request}: {', '.join(f for _, f in missing)} missing (give them in "
                       f"the file or as {', '.join(o for o, _ in missing)})")
    if missing:
        raise CliError(f"{', '.join(o for o, _ in missing)} required (or give them in --request FILE)")
    overrides = {"org_id": args.org, "agent_id": args.agent, "model": args.model, "query": args.query,
                 "recent_messages": args.message or None}
    doc.update({k: v for k, v in overrides.items() if v is not None})
    doc.setdefault("model", DEFAULT_MODEL)
    doc.setdefault("request_id", uuid.uuid4().hex)
    doc["deadline_ns"] = time.time_ns()
    try:
        return AssembleRequest.model_validate(doc)
    except ValidationError as exc:
        err = first_error(exc, root="<root>")
        if args.request and overrides.get(str(err.loc[0]) if err.loc else "") is None:
            raise CliError(f"--request {args.request}: {err.field}: {err.message}") from exc
        raise CliError(_field_error(exc)) from exc


def _request_file(path: str) -> dict[str, Any]:
    from .explain import ExplainInputError, load_json

    try:
        doc = load_json(path, "request")
    except ExplainInputError as exc:
        raise CliError(f"--request: {exc}") from exc
    if not isinstance(doc, dict):
        raise CliError(f"--request {path}: must hold a JSON object (an AssembleRequest), got {type(doc).__name__}")
    return doc


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
    from ..client.client import AsyncClient

    async with AsyncClient(args.endpoint) as c:
        return await c.assemble(request, timeout=args.timeout_ms / 1000)


def run_assemble(args: Any) -> int:
    """One assembly; exit 2 for the caller's mistakes, 1 for the service's faults (one line each)."""
    import zmq
    from pydantic import ValidationError

    from ..shared.security.auth import AuthConfigError
    from ..shared.wire.errors import ErrorCode, IbexError

    prog = f"{PROG} assemble"
    try:
        resp = asyncio.run(_call(args, _request(args)))
    except IbexError as exc:
        if exc.code in (ErrorCode.INVALID_REQUEST, ErrorCode.FORBIDDEN):  # the caller can fix these
            return fail(prog, _ibex_field_error(exc, args.request), 2)
        return fail(prog, f"{exc.code.value}: {_one_line(exc)}", 1)
    except ValidationError as exc:  # the settings or a field the client checks (until it raises InvalidRequest)
        return fail(prog, _field_error(exc), 2)
    except zmq.ZMQError as exc:  # an endpoint zmq cannot parse
        return fail(prog, f"--endpoint {args.endpoint or '(from IBEX_BROKER_ENDPOINTS)'}: {exc}", 2)
    except AuthConfigError as exc:  # IBEX_CLIENT_KEY_FILE / IBEX_BROKER_PUBLIC_KEY (docs/security.md "Authentication")
        return fail(prog, _one_line(exc), 2)
    except (ValueError, TypeError) as exc:  # CliError, and the client's own argument checks
        return fail(prog, _one_line(exc), 2)
    if args.json:
        print(resp.model_dump_json(indent=2))
    elif args.explain:
        from .explain import render_table

        render_table(resp, sys.stdout)
    else:
        print_response(resp, full=args.full)
    hint = empty_context_hint(resp)
    if hint:
        print(f"{prog}: hint: {hint}", file=sys.stderr)
    return 0


def _ibex_field_error(exc: Any, request_file: str | None = None) -> str:
    """``--option: what is wrong`` for a typed error that names a request field; a field only a
    request file can hold (``messages.2.content``) is named with the file."""
    if not exc.field:
        return f"{exc.code.value}: {_one_line(exc)}"
    message = " ".join(exc.message.removeprefix(f"{exc.field}:").split())
    option = OPTION_OF_FIELD.get(exc.field, "--endpoint" if exc.field == "endpoints" else None)
    if option:
        return f"{option}: {message}"
    return f"--request {request_file}: {exc.field}: {message}" if request_file else f"{exc.field}: {message}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code
