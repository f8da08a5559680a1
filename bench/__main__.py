"""``python -m bench SUITE [args]``: run one bench suite (``python -m bench --help`` lists them).

``python -m bench SUITE args`` is ``python -m bench.SUITE args``: the suite's module runs as
``__main__`` with the same arguments, so either spelling works and prints the same thing.
"""

from __future__ import annotations

import runpy
import sys

# Suite -> one line. Modules not listed are libraries of the suites (``bench.lib``, ``bench.loadgen``,
# ...) or child processes they start (``bench.peer_servers``, ``bench.litellm_upstream``,
# ``bench.tenant_attack``).
SUITES: dict[str, str] = {
    "run": "the stack under open-loop load: inproc, transport, floor, full sweeps, chaos (--quick: < 60 s)",
    "inproc": "the warm in-process pipeline of this checkout and --baseline ones, taking turns round by round",
    "hops": "CPU per request of each transport hop (broker, transport-mode worker, zmq relay, echo)",
    "floor": "the bare pyzmq floor: relay and ping-pong, no application code",
    "fairshare": "one org's goodput at the broker while another floods it (--tree: another checkout's broker)",
    "tenants": "a victim org's undegraded share and p99 while another org floods (CURVE keys, attack off/on)",
    "storage_cost": "bytes Redis holds per memory, summary and record against what the storage budget charges",
    "context_editing": "turns and words kept by clear-before-drop against drop-only, CPU per assembly",
    "peers": "this stack against the same pipeline behind grpc.aio and uvicorn, interleaved",
    "workercpu": "a full-mode worker's CPU per served assembly, beside the in-process pipeline",
    "packer_bench": "the packer against a greedy, a sketch and a MILP optimum: latency and quality",
    "pack": "the packer over cases from a JSON file (--cases C.json --out R.json)",
    "memservice": "what the reference memory service costs per assembly (CPU, Redis CPU, wall)",
    "paired_cpu": "the memory service's CPU per assembly, checkouts taking turns question by question in-process",
    "memstore": "the memory store at scale: search latency and CPU with a write before every search",
    "index_layout": "memory of an index per org against one per agent, and one org spread over a 3+3 cluster",
    "memclient": "what one memory-service call costs the worker, per HTTP client",
    "retrieval": "selection quality on the labelled questions (--suite conversations: long chats)",
    "embedcost": "what a query embedding costs per embedder variant (CPU, wall, cosine to numpy)",
    "embedstart": "what starting minilm costs per runtime, cold and cached graph (wall, resident memory)",
    "late_interaction": "a MaxSim rerank of the search's top 50 on the conversation set: quality, bytes, CPU",
    "evidence_stages": "at which search stage each conversation question's evidence is lost, and tokens packed",
    "calibration": "budget over-charge before and after usage-report calibration",
    "cache": "how much of each turn's prompt a provider's prefix cache can reuse",
    "escaping": "tokens the formatter's escaping costs",
    "wire_size": "bytes a chat assembly puts on the wire",
    "litellm": "the latency the ibex-context hook adds to a call through the LiteLLM proxy",
    "spy": "the top frames of a py-spy collapsed-stack file",
    "report": "re-render bench.run's results.md and plots from a saved results.json",
}


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [f"  {name:<{width}}  {line}" for name, line in SUITES.items()]
    return "\n".join(["usage: python -m bench SUITE [args]   (SUITE --help: the suite's own options)", "",
                      "suites:", *lines])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    suite, rest = args[0], args[1:]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m bench.{suite}", *rest]
    try:
        runpy.run_module(f"bench.{suite}", run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the suite's own sys.exit(main())
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
