"""Clear before drop against drop only, on synthetic tool-heavy agent conversations.

    python -m bench.context_editing [--conversations 60] [--seed 7] [--repeat 5]
    python -m bench.context_editing --suite tool-heavy [--sessions 8] [--turns 60] [--replay 40]

Each conversation is an agent at work: user questions, each answered after one to four tool calls
whose results are long (300 to 3,000 words of fetched pages, files, shell output), then a short
answer. Every conversation is assembled by the offline pipeline (no memories) for gpt-4 (8K) and
gpt-3.5-turbo (16K) twice: with ``history.context_editing`` off (drop only) and with its defaults
(clear before drop). Printed per model: user turns kept, user/assistant words kept (the words of
user messages and assistant text, not tool results or calls), tool uses cleared, and the CPU time
of one assembly (process time, median and p90 over ``--repeat`` runs of each conversation, after
one warm-up assembly per model). Drop only is the pipeline as it was before clear before drop
(the planner returns at once when it is off), so its CPU column is the "before".

``--suite tool-heavy``: the coding-agent sessions of ``bench.tool_heavy`` (labelled facts stated
early and asked about late, tool outputs of 2 to 50 KB) fitted into a 32K and a 128K window (o200k,
4,096 reserved for the reply), drop only against clear before drop (defaults). Per window and rule:
sessions that overflow, user/assistant messages kept, labelled facts kept, tokens sent (mean), and
prefix reuse: the last ``--replay`` model calls of each session assembled one after the other, each
call's messages (JSON) compared with the previous call's; reuse is the shared leading characters
over the call's characters, summed over calls (a call that overflows starts over).
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from typing import Any

from bench import tool_heavy
from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median, percentile
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.shared.wire.errors import ContextOverflow
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse

TOOLS = ["search_web", "read_file", "run_shell", "fetch_url"]
TOOL_DEFS = [{"type": "function", "function": {"name": n, "description": f"{n} for the agent",
                                               "parameters": {"type": "object",
                                                              "properties": {"q": {"type": "string"}}}}}
             for n in TOOLS]
VOCAB = ("the invoice report build failed because module config value returned error line page section "
         "customer order total status pending shipped test passed coverage function class import").split()
MODELS = ("gpt-4", "gpt-3.5-turbo")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    """One agent conversation, OpenAI-shaped, ending on a user turn."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding and research agent."}]
    calls = 0
    for t in range(rng.randint(4, 14)):
        out.append({"role": "user", "content": f"step {t}: " + _words(rng, rng.randint(8, 60))})
        for _ in range(rng.randint(1, 4)):
            cid = f"call_{calls}"
            calls += 1
            call = {"name": rng.choice(TOOLS), "arguments": f'{{"q": "{_words(rng, 4)}"}}'}
            out.append({"role": "assistant", "content": None,
                        "tool_calls": [{"id": cid, "type": "function", "function": call}]})
            out.append({"role": "tool", "tool_call_id": cid, "content": _words(rng, rng.randint(300, 3000))})
        out.append({"role": "assistant", "content": _words(rng, rng.randint(20, 120))})
    out.append({"role": "user", "content": "what next? " + _words(rng, 20)})
    return out


def _conversation_words(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(user turns, user/assistant words) of what is sent."""
    turns = sum(1 for m in messages if m.get("role") == "user")
    words = sum(len(m["content"].split()) for m in messages
                if m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str))
    return turns, words


def run_one(engine: Engine, convo: list[dict[str, Any]], model: str, enabled: bool,
            repeat: int) -> tuple[AssembleResponse | None, list[float]]:
    req = AssembleRequest(request_id="b", org_id="bench", agent_id="agent", model=model, query="next", format="openai",
                          messages=convo, tools=TOOL_DEFS, deadline_ns=1,
                          history={"context_editing": {"enabled": enabled}})  # type: ignore[arg-type]
    retrieval = offline_result(directive="Work step by step.", hot=[], cold=[])
    cpu: list[float] = []
    resp = None
    for _ in range(repeat):
        t = cpu_seconds()
        try:
            resp = assemble(req, retrieval, engine)
        except ContextOverflow:
            resp = None
        cpu.append(cpu_seconds() - t)
    return resp, cpu


WINDOWS = {"32K": 32_768, "128K": 131_072}


def window_catalog() -> Catalog:
    """The shipped catalog plus an o200k model per window of ``WINDOWS``."""
    text = resources.files("ibex_context.pipeline.budget").joinpath("catalog.json").read_text("utf-8")
    data = json.loads(text)
    for name, size in WINDOWS.items():
        data["models"][f"o200k-{name}"] = {"family": "o200k", "context_window": size, "max_output": 4096}
    return Catalog(data)


def _heavy_one(engine: Engine, messages: list[dict[str, Any]], model: str, enabled: bool) -> AssembleResponse | None:
    req = AssembleRequest(request_id="b", org_id="bench", agent_id="agent", model=model, query="next", format="openai",
                          messages=messages, tools=tool_heavy.TOOL_DEFS, deadline_ns=1,
                          history={"context_editing": {"enabled": enabled}})  # type: ignore[arg-type]
    try:
        return assemble(req, offline_result(directive="Work step by step.", hot=[], cold=[]), engine)
    except ContextOverflow:
        return None


def common_prefix(a: str, b: str) -> int:
    """Leading characters ``a`` and ``b`` share."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest equal prefix, by halving (string slices compare in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def replay_reuse(engine: Engine, s: tool_heavy.Session, model: str, enabled: bool, calls: int) -> tuple[int, int]:
    """(shared leading characters, characters) over the session's last ``calls`` model calls."""
    prev, shared, total = "", 0, 0
    for n in s.calls[-calls - 1:]:
        resp = _heavy_one(engine, s.messages[:n], model, enabled)
        if resp is None or resp.messages is None:
            prev = ""
            continue
        text = json.dumps(resp.messages)
        if prev:
            shared += common_prefix(prev, text)
            total += len(text)
        prev = text
    return shared, total


def tool_heavy_suite(args: argparse.Namespace) -> int:
    sessions = tool_heavy.sessions(args.seed, args.sessions, args.turns)
    engine = Engine(window_catalog(), Policy())
    words = sum(tool_heavy.words_kept(s.messages) for s in sessions)
    facts = sum(len(s.facts) for s in sessions)
    size = sum(len(m.get("content") or "") for s in sessions for m in s.messages) / len(sessions)
    print(f"{len(sessions)} sessions of {args.turns} turns, {words} user/assistant messages, {facts} labelled "
          f"facts, {size / 1e6:.2f} MB of content each on average; seed {args.seed}; reuse over the last "
          f"{args.replay} calls of each\n")
    print("| window | rule | overflow | user/assistant messages kept | labelled facts kept | tokens sent (mean) "
          "| prefix reuse |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in WINDOWS:
        model = f"o200k-{name}"
        for enabled, rule in ((False, "drop only"), (True, "clear then drop")):
            kept = known = overflow = 0
            sent: list[int] = []
            shared = chars = 0
            for s in sessions:
                resp = _heavy_one(engine, s.messages, model, enabled)
                a, b = replay_reuse(engine, s, model, enabled, args.replay)
                shared, chars = shared + a, chars + b
                if resp is None or resp.messages is None or resp.prompt_tokens is None:
                    overflow += 1
                    continue
                kept += tool_heavy.words_kept(resp.messages)
                known += tool_heavy.facts_kept(resp.messages, s.facts)
                sent.append(resp.prompt_tokens)
            print(f"| {name} | {rule} | {overflow} | {kept} ({kept / words:.1%}) | {known} of {facts} "
                  f"| {sum(sent) / max(1, len(sent)):.0f} | {shared / max(1, chars):.1%} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("words", "tool-heavy"), default="words")
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=8, help="tool-heavy sessions")
    ap.add_argument("--turns", type=int, default=60, help="work turns per tool-heavy session")
    ap.add_argument("--replay", type=int, default=40, help="model calls replayed per session for prefix reuse")
    args = ap.parse_args(argv)
    if args.suite == "tool-heavy":
        return tool_heavy_suite(args)
    rng = random.Random(args.seed)
    convos = [conversation(rng) for _ in range(args.conversations)]
    engine = Engine(Catalog.load(), Policy())
    for model in MODELS:  # load the encodings and warm the count caches before anything is timed
        run_one(engine, convos[0], model, True, 1)
    total_turns = sum(_conversation_words(c)[0] for c in convos)
    total_words = sum(_conversation_words(c)[1] for c in convos)
    print(f"{len(convos)} conversations, {total_turns} user turns, {total_words} user/assistant words, "
          f"{sum(1 for c in convos for m in c if m['role'] == 'tool')} tool results; seed {args.seed}\n")
    print("| model | rule | overflow | user turns kept | user/assistant words kept | tool uses cleared "
          "| CPU / assembly p50 | p90 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for enabled, rule in ((False, "drop only"), (True, "clear before drop")):
            turns = words = cleared = overflow = 0
            cpu: list[float] = []
            for convo in convos:
                resp, times = run_one(engine, convo, model, enabled, args.repeat)
                cpu += times
                if resp is None or resp.messages is None:
                    overflow += 1
                    continue
                t, w = _conversation_words(resp.messages)
                turns += t
                words += w
                cleared += sum(1 for m in resp.messages if m.get("role") == "tool"
                               and isinstance(m.get("content"), list))
            print(f"| {model} | {rule} | {overflow} | {turns} ({turns / total_turns:.1%}) | {words} "
                  f"({words / total_words:.1%}) | {cleared} | {median(cpu) * 1e3:.2f} ms "
                  f"| {percentile(cpu, 90) * 1e3:.2f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
