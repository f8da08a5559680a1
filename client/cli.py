"""``ibex-context``: one command for operators and developers.

    ibex-context demo                 start the stack (if needed), seed demo data, print assemblies
    ibex-context up | down | status   the stack under supervisord, in the background (state in .run/)
    ibex-context assemble ...         one assembly against the running stack
    ibex-context explain ...          the whole CPU pipeline offline on JSON files (no network)
    ibex-context directive ...        set / show / delete an agent's directive in Redis
    ibex-context seed ...             load memories and directives from JSONL
    ibex-context keys ...             CURVE keypairs for callers, workers and the broker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


def _explain_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="run budget, scoring, packing and formatting offline on JSON files")
    p.add_argument("--request", required=True, help="AssembleRequest as JSON (deadline_ns optional)")
    p.add_argument("--candidates", required=True, help='{"directive": str|null, "hot": [hit], "cold": [hit]}')
    p.add_argument("--nonce", default=None, help="fixed hex nonce for byte-identical output")
    p.add_argument("--format", choices=["json", "table"], default="table")


def _assemble_parser(sub: Any) -> None:
    p = sub.add_parser("assemble", help="assemble context through the running broker")
    p.add_argument("--org", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--model", default="gpt-4o")
    p.add_argument("--query", required=True)
    p.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT",
                   help="a recent message, e.g. user:hello (repeatable)")
    p.add_argument("--timeout-ms", type=float, default=200.0)
    p.add_argument("--endpoint", default=None, help="broker frontend(s), comma-separated")
    p.add_argument("--json", action="store_true", help="print the whole AssembleResponse as JSON")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ibex-context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _explain_parser(sub)
    _assemble_parser(sub)
    for name, text in [("up", "start the stack in the background under supervisord"),
                       ("down", "stop the background stack"), ("status", "show the broker's counters and workers")]:
        sub.add_parser(name, help=text)
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
    sub.add_parser("directive", help="set/show/delete a directive (see: ibex-context directive -h)", add_help=False)
    sub.add_parser("seed", help="load memories and directives from JSONL", add_help=False)
    return ap


def _print_response(resp: Any) -> None:
    b = resp.budget
    print(f"request {resp.request_id}  worker {resp.worker_id or '-'}  model {b.model}")
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


async def _assemble(args: Any) -> int:
    from client.client import AsyncClient
    from shared.errors import IbexError

    messages = []
    for m in args.message:
        role, _, text = m.partition(":")
        messages.append({"role": role, "content": text})
    async with AsyncClient(args.endpoint) as c:
        try:
            resp = await c.assemble(org_id=args.org, agent_id=args.agent, model=args.model, query=args.query,
                                    recent_messages=messages, timeout=args.timeout_ms / 1000)
        except IbexError as exc:
            print(f"ibex-context assemble: {exc.code.value}: {exc.message}", file=sys.stderr)
            return 1
    if args.json:
        print(resp.model_dump_json(indent=2))
    else:
        _print_response(resp)
    return 0


def _keys(args: Any) -> int:
    from pathlib import Path

    from shared import auth

    try:
        if args.keys_cmd == "generate":
            key, pub = auth.write_keypair(Path(args.dir), args.name)
            print(f"wrote {key} (secret, mode 0600) and {pub}")
        else:
            agents = [a.strip() for a in args.agents.split(",") if a.strip()]
            auth.register(Path(args.keys_file), public_key=auth.load_public_key(args.public), role=args.role,
                          name=args.name, org_id=args.org, agents=agents)
            print(f"registered {args.role} {args.name} in {args.keys_file}")
    except auth.AuthConfigError as exc:
        print(f"ibex-context keys: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "directive":
        from memory.directive_cli import main as directive_main

        return int(directive_main(argv[1:]) or 0)
    if argv and argv[0] == "seed":
        from memory.seed import main as seed_main

        return int(seed_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    if args.cmd == "explain":
        from client.explain import run

        return run(args)
    if args.cmd == "assemble":
        return asyncio.run(_assemble(args))
    if args.cmd == "keys":
        return _keys(args)
    import client.stack as stack

    if args.cmd == "up":
        return stack.up()
    if args.cmd == "down":
        return stack.down()
    if args.cmd == "status":
        status = stack.status()
        print(json.dumps(status, indent=2))
        return 0 if status else 1
    if args.cmd == "demo":
        return stack.demo(keep=args.keep, show=_print_response)
    return 2


if __name__ == "__main__":
    sys.exit(main())
