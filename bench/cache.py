"""``python -m bench.cache``: how much of each turn's prompt a provider's prefix cache can reuse.

Why: a provider bills a cached prefix at a fraction of the price (docs/assembly.md "Chat-native assembly"
places the memory block late for that reason). Scripted tool-using agent conversations, with
memories that change every user turn (``--churn call``: every model call), are assembled under
three layouts and each call's prompt is compared with the previous call's, token by token, as the
provider's cache sees it.
A cache only reuses the longest common prefix: a block that changes early makes the rest new.

Layouts: ``seed`` (the simple form's flat ``rendered`` text as one system message, then the latest
user message, with the seed's fresh random nonce per assembly), ``sysmem`` (directive + memory
block in one leading system message, then the conversation: what most frameworks do) and
``service`` (exactly what ``assemble`` returns, so this measures whatever layout is on the branch).

``--suite tool-heavy``: the coding-agent sessions of ``bench.tool_heavy`` (tool outputs of 2 to 50 KB,
far past the window), the ``service`` layout only, with ``history.context_editing`` on (defaults)
and off (drop only), memories changing every user turn. The last ``--calls`` model calls of each
session are compared, each with the call before it, as above.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import tool_heavy
from bench.lib.percentiles import median, percentile
from bench.lib.tables import table
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse

DEMO = Path(__file__).resolve().parent.parent / "memory" / "data" / "demo.jsonl"
LAYOUTS = ("seed", "sysmem", "service")
FORMATS = ("openai", "anthropic")
MIN_CACHE = 1024  # both providers cache only prompts (prefixes) of at least 1,024 tokens
OPENAI_STEP = 128
# Prices, USD per 1M input tokens. gpt-4o: $2.50 input, $1.25 cached input (OpenAI's pricing
# page, developers.openai.com/api/docs/pricing, as reproduced by third-party tables; not confirmed
# on the live page). claude-sonnet-4: $3 base input, cache writes 1.25x ($3.75), cache hits 0.1x
# ($0.30) (platform.claude.com/docs/en/about-claude/pricing "Sonnet" rows and Google Vertex AI's
# Claude prompt-caching page: writes +25 %, reads -90 %).
PRICES = {"openai": {"input": 2.50, "cached": 1.25},
          "anthropic": {"input": 3.00, "read": 0.30, "write": 3.75}}
ENCODING = "o200k"  # Anthropic's tokenizer is not public: o200k stands in for it (the ratios matter)

Msg = dict[str, Any]


# ------------------------------------------------------------------------------------ the scripts
def _tool(name: str, desc: str, arg: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"}}, "required": [arg]}}}


SCRIPTS: dict[str, dict[str, Any]] = {
    "support": {"agent": "support-bot", "tools": [
        _tool("lookup_invoice", "Find an invoice by number or month and return its lines", "invoice"),
        _tool("lookup_account", "Return the account's plan, seats and payment method", "account")],
        "ask": "Can you check invoice {n}? The {item} line looks wrong to me.",
        "call": ("lookup_invoice", "invoice", "INV-{n}"),
        "result": "Invoice INV-{n} (account acme-{k}), issued 2026-{m:02d}-03, due 2026-{m:02d}-17.\n{lines}"
                  "Subtotal {sub} EUR, VAT 21 %, total {tot} EUR. Status: {status}.",
        "answer": "Invoice INV-{n}: the {item} line is {qty} x {price} EUR as on your plan; "
                  "total {tot} EUR, {status}."},
    "research": {"agent": "research-agent", "tools": [
        _tool("search_papers", "Full-text search over the paper index; returns titles and abstracts", "query"),
        _tool("read_section", "Return one section of a paper by id and section name", "section")],
        "ask": "What does paper {n} say about {item}? Summarise the method section.",
        "call": ("read_section", "section", "paper-{n}#method"),
        "result": "Paper {n}, section 3 (Method). We study {item} on {qty} datasets.\n{lines}"
                  "The ablation keeps {sub} of {tot} configurations. Limitations: {status}.",
        "answer": "Paper {n} evaluates {item} on {qty} datasets; {sub} of {tot} configurations survive; "
                  "caveat: {status}."},
    "coding": {"agent": "devops-helper", "tools": [
        _tool("run_command", "Run a shell command in the repository sandbox and return its output", "command"),
        _tool("read_file", "Return a file's content with line numbers", "path")],
        "ask": "The {item} job failed again (run {n}). Can you find out why?",
        "call": ("run_command", "command", "ci logs --run {n} --job {item} --tail 20"),
        "result": "$ ci logs --run {n} --job {item} --tail 20\n{lines}"
                  "exit status {qty}; {sub} passed, {tot} total; hint: {status}",
        "answer": "Run {n} of {item} failed with exit {qty}: {sub}/{tot} passed; the cause is: {status}."},
}
ITEMS = ("storage", "egress", "support plan", "backup", "seats", "compute", "snapshots", "licences")
STATUSES = ("paid", "overdue since last week", "disputed by the customer", "partly refunded",
            "pending bank transfer", "written off after review")


def _lines(seed: int, kind: str) -> str:
    """Deterministic, varied body lines (~15 per result) so tool results have realistic length."""
    out = []
    for j in range(12 + seed % 7):
        v = (seed * 7919 + j * 104729) % 100_000
        if kind == "coding":
            out.append(f"  [{j:02d}] tests/test_mod_{v % 97}.py::test_case_{v % 13} "
                       f"{'FAILED' if v % 5 == 0 else 'PASSED'} ({v % 900} ms)\n")
        else:
            out.append(f"  {j + 1}. {ITEMS[v % len(ITEMS)]}: {v % 50 + 1} x {v % 300 / 7:.2f} "
                       f"(ref {v:05d}, note {STATUSES[v % len(STATUSES)]})\n")
    return "".join(out)


def _fields(name: str, t: int) -> dict[str, Any]:
    n = 1000 + t * 37 + len(name)
    sub = (t * 613) % 5000 + 100
    return {"n": n, "k": t % 9, "m": t % 12 + 1, "item": ITEMS[(t * 3 + len(name)) % len(ITEMS)],
            "qty": t % 7 + 1, "price": f"{(t * 17) % 90 + 9}.00", "sub": sub, "tot": sub * 121 // 100,
            "status": STATUSES[(t * 5) % len(STATUSES)], "lines": _lines(t + len(name), name)}


def tool_calls_in_turn(t: int) -> int:
    """How many tools turn ``t`` calls before answering: 1, 2 or 3 in turn (agents loop)."""
    return 1 + t % 3


def turn_messages(name: str, t: int) -> list[Msg]:
    """Turn ``t`` of script ``name`` in OpenAI shape: a question, one to three tool calls each with its
    result, then the answer."""
    s, f = SCRIPTS[name], _fields(name, t)
    fn, arg, val = s["call"]
    out: list[Msg] = [{"role": "user", "content": s["ask"].format(**f)}]
    for c in range(tool_calls_in_turn(t)):
        g = f if c == 0 else _fields(name, t * 10 + c + 100)
        cid = f"call_{t}" if c == 0 else f"call_{t}_{c}"
        call = {"id": cid, "type": "function",
                "function": {"name": fn, "arguments": json.dumps({arg: val.format(**g)})}}
        out += [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": cid, "content": s["result"].format(**g)}]
    return [*out, {"role": "assistant", "content": s["answer"].format(**f)}]


def model_calls(turns: int) -> list[tuple[int, int]]:
    """Every model call of a script as (turn, step): an agent loop calls the model once with the
    user's question and once after each tool result, so turn ``t`` makes ``tool_calls_in_turn(t) + 1``."""
    return [(t, step) for t in range(turns) for step in range(tool_calls_in_turn(t) + 1)]


def conversation(name: str, turn: int, step: int) -> list[Msg]:
    """What the agent sends at step ``step`` of turn ``turn``: every earlier turn, the question and
    the first ``step`` tool calls with their results."""
    msgs = [m for t in range(turn) for m in turn_messages(name, t)]
    return msgs + turn_messages(name, turn)[:1 + 2 * step]


def load_memories() -> dict[str, list[str]]:
    by_agent: dict[str, list[str]] = {}
    for line in DEMO.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "memory":
            by_agent.setdefault(row["agent_id"], []).append(row["content"])
    return by_agent


def turn_hits(pool: list[str], turn: int, k: int = 8) -> list[MemoryHit]:
    """The memories retrieval returns at ``turn``: a deterministic, turn-dependent draw from the pool."""
    picks = sorted({(turn * 11 + j * 29 + (turn * j) % 7) % len(pool) for j in range(k)})
    return [MemoryHit(f"m{i}", pool[i], "fact", 0.95 - r / 100, 0.8, r + 1, "hot") for r, i in enumerate(picks)]


def load_directives() -> dict[str, str]:
    rows = [json.loads(line) for line in DEMO.read_text().splitlines()]
    return {r["agent_id"]: r["text"] for r in reversed(rows) if r.get("kind") == "directive"}


def to_anthropic(msgs: list[Msg]) -> list[Msg]:
    """The same conversation in Anthropic's shape: tool_use blocks, tool_result in a user turn."""
    out: list[Msg] = []
    for m in msgs:
        if m.get("tool_calls"):
            c = m["tool_calls"][0]
            out.append({"role": "assistant", "content": [{"type": "tool_use", "id": c["id"],
                        "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


# ---------------------------------------------------------------------------------------- layouts
class Turn:
    """Everything one model call needs: the script's conversation, tools, directive and its hits."""

    def __init__(self, name: str, turn: int, step: int, directive: str, hits: list[MemoryHit]) -> None:
        self.name, self.turn, self.step, self.directive, self.hits = name, turn, step, directive, hits
        self.messages = conversation(name, turn, step)
        self.tools: list[dict[str, Any]] = SCRIPTS[name]["tools"]
        self.agent: str = SCRIPTS[name]["agent"]


def _question(t: Turn) -> str:
    """The latest user message (the retrieval query, and the seed's trailing user message)."""
    return str(next(m["content"] for m in reversed(t.messages) if m["role"] == "user"))


def _assemble(catalog: Catalog, t: Turn, body: dict[str, Any]) -> AssembleResponse:
    req = AssembleRequest.model_validate({
        "request_id": f"cache-{t.name}-{t.turn}-{t.step}", "org_id": "acme", "agent_id": t.agent,
        "model": body.pop("model"),
        "query": _question(t), "deadline_ns": time.time_ns() + 3_600_000_000_000, **body})
    return assemble(req, offline_result(directive=t.directive, hot=t.hits, cold=[]), Engine(catalog, Policy()))


def _flat(m: Msg) -> dict[str, str]:
    """A chat message as the simple form's flat {role, content} (tool calls written as JSON)."""
    text = m["content"] or ""
    if m.get("tool_calls"):
        text += json.dumps(m["tool_calls"], sort_keys=True)
    return {"role": m["role"], "content": text}


def seed_layout(catalog: Catalog, t: Turn, fmt: str) -> tuple[Any, list[Msg]]:
    """The seed's order: the simple form's ``rendered`` (directive, history, memories, tools) as ONE
    system message, then the latest user message."""
    resp = _assemble(catalog, t, {"model": _model(fmt), "recent_messages": [_flat(m) for m in t.messages],
                                  "tool_schemas": t.tools, "options": {"nonce": "random"}})
    last = {"role": "user", "content": _question(t)}
    if fmt == "openai":
        return None, [{"role": "system", "content": resp.rendered}, last]
    return [{"type": "text", "text": resp.rendered}], [last]


def _memory_block(resp: AssembleResponse) -> str:
    """The nonce-tagged memory block wherever ``assemble`` placed it (a message, a system block or a
    block of the latest user turn)."""
    tag = f'nonce="{resp.nonce}"'
    parts: list[Any] = list(resp.system or [])
    for m in resp.messages or []:
        parts += [m.get("content")] if isinstance(m.get("content"), str) else list(m.get("content") or [])
    for p in parts:
        text = p if isinstance(p, str) else p.get("text", "") if isinstance(p, dict) else ""
        if tag in text and text.lstrip().startswith("<"):
            return str(text)
    return next(str(p if isinstance(p, str) else p.get("text")) for p in parts
                if tag in (p if isinstance(p, str) else str(p.get("text", ""))))


def _model(fmt: str) -> str:
    return "gpt-4o" if fmt == "openai" else "claude-sonnet-4-20250514"


def _service(catalog: Catalog, t: Turn, fmt: str) -> AssembleResponse:
    if fmt == "openai":
        body = {"model": _model(fmt), "format": "openai", "messages": t.messages, "tools": t.tools}
    else:
        body = {"model": _model(fmt), "format": "anthropic", "messages": to_anthropic(t.messages),
                "tools": anthropic_tools(t.tools)}
    return _assemble(catalog, t, body)


def service_layout(catalog: Catalog, t: Turn, fmt: str) -> tuple[Any, list[Msg]]:
    """This service: exactly what ``assemble`` returns (``system`` + ``messages`` for Anthropic)."""
    resp = _service(catalog, t, fmt)
    return resp.system, list(resp.messages or [])


def sysmem_layout(catalog: Catalog, t: Turn, fmt: str) -> tuple[Any, list[Msg]]:
    """What most frameworks do: one leading system prompt with the directive and the memory block,
    then the conversation as is. The memory block is this service's own, for a like-for-like text."""
    block = _memory_block(_service(catalog, t, fmt))
    system = f"{t.directive}\n\n{block}"
    if fmt == "openai":
        return None, [{"role": "system", "content": system}, *t.messages]
    return [{"type": "text", "text": system}], to_anthropic(t.messages)


LAYOUT_FNS: dict[str, Callable[[Catalog, Turn, str], tuple[Any, list[Msg]]]] = {
    "seed": seed_layout, "sysmem": sysmem_layout, "service": service_layout}


# ---------------------------------------------------------------------------- what the cache sees
def _block_text(b: Any) -> str:
    if isinstance(b, str):
        return b
    if isinstance(b, dict) and b.get("type") == "text":
        return str(b["text"])
    return json.dumps(b, sort_keys=True, separators=(",", ":"))


def canonical(fmt: str, tools: list[dict[str, Any]], system: Any, messages: list[Msg]) -> str:
    """The prompt as the provider's cache sees it, in its order: tools, (system), then each message
    as role + content, tool calls as JSON. Deterministic: sorted keys, fixed separators."""
    out = [json.dumps(anthropic_tools(tools) if fmt == "anthropic" else tools, sort_keys=True, separators=(",", ":"))]
    if system:
        out += ["<|system|>", *(_block_text(b) for b in (system if isinstance(system, list) else [system]))]
    for m in messages:
        content = m.get("content")
        parts = [content] if isinstance(content, str) else list(content or [])
        out += [f"<|{m['role']}|>", *(_block_text(p) for p in parts)]
        if m.get("tool_calls"):
            out.append(json.dumps(m["tool_calls"], sort_keys=True, separators=(",", ":")))
        if m.get("tool_call_id"):
            out.append(m["tool_call_id"])
    return "\n".join(out)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def openai_cached(prefix: int, tokens: int) -> int:
    """OpenAI bills as cached the reused prefix in 128-token steps, and only from 1,024 tokens."""
    if tokens < MIN_CACHE or prefix < MIN_CACHE:
        return 0
    return prefix // OPENAI_STEP * OPENAI_STEP


def turn_cost(fmt: str, tokens: int, prefix: int) -> float:
    """USD for one turn's input. Anthropic: an ideal breakpoint at the end of each prompt, so the
    reused prefix is a cache read and the rest a cache write (below 1,024 tokens nothing caches)."""
    p = PRICES[fmt]
    if fmt == "openai":
        cached = openai_cached(prefix, tokens)
        return ((tokens - cached) * p["input"] + cached * p["cached"]) / 1e6
    if tokens < MIN_CACHE:
        return tokens * p["input"] / 1e6
    read = prefix if prefix >= MIN_CACHE else 0
    return (read * p["read"] + (tokens - read) * p["write"]) / 1e6


def _pct(xs: list[float], q: float) -> float:
    return percentile(xs, q * 100) if xs else float("nan")


# ------------------------------------------------------------------------------------------- run
CHURNS = ("turn", "call")


def run_script(catalog: Catalog, name: str, turns: int, enc: Any, churn: str = "turn") -> list[dict[str, Any]]:
    """Per (format, layout): each model call's tokens, reused prefix, and the summary over the script.

    ``churn``: when retrieval returns new memories. ``turn`` (the realistic case): once per user turn,
    since the retrieval query is the user's question and stays the same through the turn's tool loop.
    ``call`` (a stress case): a new draw at every model call, as if the store changed between calls.
    """
    pool = load_memories()[SCRIPTS[name]["agent"]]
    directive = load_directives()[SCRIPTS[name]["agent"]]
    calls = model_calls(turns)
    rows = []
    for fmt in FORMATS:
        for layout in LAYOUTS:
            prev: list[int] = []
            per_call = []
            for i, (turn, step) in enumerate(calls):
                t = Turn(name, turn, step, directive, turn_hits(pool, turn if churn == "turn" else i))
                system, msgs = LAYOUT_FNS[layout](catalog, t, fmt)
                toks = enc.encode_ordinary(canonical(fmt, t.tools, system, msgs))
                pre = common_prefix(prev, toks)
                per_call.append({"turn": turn, "step": step, "tokens": len(toks), "prefix": pre,
                                 "reuse": pre / len(toks), "bound": min(len(prev), len(toks)) / len(toks),
                                 "cost": turn_cost(fmt, len(toks), pre)})
                prev = toks
            rows.append(summarise(name, fmt, layout, per_call) | {"churn": churn})
    return rows


def summarise(name: str, fmt: str, layout: str, per_turn: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over calls after the first with a prompt >= 1,024 tokens (what a provider caches),
    split into a turn's first call (new question, new memories) and its tool-loop calls; and the
    token-weighted share over the whole run, which is what the bill follows."""
    calls = [p for p in per_turn[1:] if p["tokens"] >= MIN_CACHE]
    big = [p["reuse"] for p in calls]
    billed = [openai_cached(p["prefix"], p["tokens"]) / p["tokens"] for p in calls] if fmt == "openai" else []

    def med(xs: list[float]) -> float:
        return median(xs) if xs else float("nan")
    return {"script": name, "format": fmt, "layout": layout, "turns": len(per_turn),
            "turns_over_1024": len(big), "median_reuse": med(big), "p10_reuse": _pct(big, 0.10),
            "median_reuse_new_turn": med([p["reuse"] for p in calls if p.get("step", 0) == 0]),
            "median_reuse_tool_loop": med([p["reuse"] for p in calls if p.get("step", 0) > 0]),
            "weighted_reuse": sum(p["prefix"] for p in calls) / max(1, sum(p["tokens"] for p in calls)),
            "median_bound": med([p["bound"] for p in calls]),
            "median_billed_cached": med(billed) if billed else None,
            "cost_usd": sum(p["cost"] for p in per_turn),
            "uncached_cost_usd": sum(p["tokens"] for p in per_turn) * PRICES[fmt]["input"] / 1e6,
            "per_turn": per_turn}


def render(rows: list[dict[str, Any]]) -> list[str]:
    head = ["script", "memories change", "provider", "layout", "calls >= 1,024", "median reuse", "p10",
            "new turn (median)", "tool loop (median)", "token-weighted", "append-only bound",
            "OpenAI billed cached", "input cost $", "no-cache cost $"]
    body = [[r["script"], f"every {r.get('churn', 'turn')}", r["format"], r["layout"], r["turns_over_1024"],
             f"{r['median_reuse']:.1%}", f"{r['p10_reuse']:.1%}", f"{r['median_reuse_new_turn']:.1%}",
             f"{r['median_reuse_tool_loop']:.1%}", f"{r['weighted_reuse']:.1%}", f"{r['median_bound']:.1%}",
             "-" if r["median_billed_cached"] is None else f"{r['median_billed_cached']:.1%}",
             f"{r['cost_usd']:.4f}", f"{r['uncached_cost_usd']:.4f}"] for r in rows]
    return table(head, body)


HEAVY_AGENT = "devops-helper"  # the demo agent whose memories and directive the sessions use


def _heavy_call(catalog: Catalog, fmt: str, msgs: list[Msg], hits: list[MemoryHit], directive: str,
                clearing: bool) -> tuple[Any, list[Msg]]:
    """One model call of a tool-heavy session as ``assemble`` returns it: (system, messages)."""
    body: dict[str, Any] = {"model": _model(fmt), "format": fmt, "tools": tool_heavy.TOOL_DEFS, "messages": msgs,
                            "history": {"context_editing": {"enabled": clearing}}}
    if fmt == "anthropic":
        system, body["messages"] = tool_heavy.to_anthropic(msgs)
        body |= {"system": system, "tools": anthropic_tools(tool_heavy.TOOL_DEFS)}
    query = next(str(m["content"]) for m in reversed(msgs) if m["role"] == "user")
    req = AssembleRequest.model_validate({
        "request_id": "cache-heavy", "org_id": "acme", "agent_id": HEAVY_AGENT, "query": query,
        "deadline_ns": time.time_ns() + 3_600_000_000_000, **body})
    resp = assemble(req, offline_result(directive=directive, hot=hits, cold=[]), Engine(catalog, Policy()))
    return resp.system, list(resp.messages or [])


def run_tool_heavy(catalog: Catalog, enc: Any, sessions: list[tool_heavy.Session], calls: int) -> list[dict[str, Any]]:
    """Per (format, clearing on/off): each replayed call's tokens and reused prefix, summarised."""
    pool, directive = load_memories()[HEAVY_AGENT], load_directives()[HEAVY_AGENT]
    rows = []
    for fmt in FORMATS:
        for clearing in (True, False):
            per_call = []
            for s in sessions:
                prev: list[int] = []
                for n in s.calls[-calls - 1:]:
                    msgs = s.messages[:n]
                    turn = sum(1 for m in msgs if m["role"] == "user")
                    system, out = _heavy_call(catalog, fmt, msgs, turn_hits(pool, turn), directive, clearing)
                    toks = enc.encode_ordinary(canonical(fmt, tool_heavy.TOOL_DEFS, system, out))
                    pre = common_prefix(prev, toks)
                    if prev:
                        per_call.append({"turn": turn, "step": int(msgs[-1]["role"] == "tool"), "tokens": len(toks),
                                         "prefix": pre, "reuse": pre / len(toks),
                                         "bound": min(len(prev), len(toks)) / len(toks),
                                         "cost": turn_cost(fmt, len(toks), pre)})
                    prev = toks
            layout = "service, clearing " + ("on" if clearing else "off")
            first = {"tokens": 0, "cost": 0.0}  # summarise skips a script's first call
            rows.append(summarise("tool-heavy", fmt, layout, [first, *per_call]) | {"churn": "turn"})
    return rows


def tool_heavy_main(args: argparse.Namespace) -> int:
    catalog = Catalog.load()
    enc = catalog.counter(ENCODING).inner._enc  # type: ignore[attr-defined]
    sessions = tool_heavy.sessions(args.seed, args.sessions, args.session_turns)
    start = time.perf_counter()
    rows = run_tool_heavy(catalog, enc, sessions, args.calls)
    print(f"tool-heavy: {len(sessions)} sessions of {args.session_turns} turns (seed {args.seed}), the last "
          f"{args.calls} model calls of each ({time.perf_counter() - start:.1f} s)")
    print("\n".join(render(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cache-tool-heavy.json"
    path.write_text(json.dumps({"encoding": ENCODING, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("scripts", "tool-heavy"), default="scripts")
    ap.add_argument("--sessions", type=int, default=2, help="tool-heavy sessions")
    ap.add_argument("--session-turns", type=int, default=60, help="work turns per tool-heavy session")
    ap.add_argument("--calls", type=int, default=60, help="model calls replayed per tool-heavy session")
    ap.add_argument("--seed", type=int, default=7, help="tool-heavy sessions' seed")
    ap.add_argument("--scripts", default=",".join(SCRIPTS), help=f"comma-separated, of {', '.join(SCRIPTS)}")
    ap.add_argument("--turns", type=int, default=24,
                    help="user turns per script, 1-3 tool calls each, so 2-4 model calls (default 24)")
    ap.add_argument("--churn", default=",".join(CHURNS),
                    help="when retrieval returns new memories: 'turn' (per user question), 'call' (every model call)")
    ap.add_argument("--out", type=Path, default=Path("bench/out"), help="directory for cache.json")
    args = ap.parse_args(argv)
    if args.suite == "tool-heavy":
        return tool_heavy_main(args)
    names = [s for s in args.scripts.split(",") if s]
    unknown = [s for s in names if s not in SCRIPTS]
    if unknown:
        ap.error(f"unknown script(s): {', '.join(unknown)}")
    churns = [c for c in args.churn.split(",") if c]
    if not churns or any(c not in CHURNS for c in churns):
        ap.error(f"--churn: a comma-separated list of {', '.join(CHURNS)}")
    catalog = Catalog.load()
    enc = catalog.counter(ENCODING).inner._enc  # type: ignore[attr-defined]
    rows: list[dict[str, Any]] = []
    for name in names:
        start = time.perf_counter()
        for churn in churns:
            got = run_script(catalog, name, args.turns, enc, churn)
            rows += got
            print(f"{name}, memories change every {churn}: {args.turns} turns ({len(model_calls(args.turns))} "
                  "model calls), " + ", ".join(f"{r['format']}/{r['layout']} {r['median_reuse']:.1%}" for r in got)
                  + f" ({time.perf_counter() - start:.1f} s)", flush=True)
    print("\n".join(render(rows)))
    print(f"\nPrices per 1M input tokens: {json.dumps(PRICES)}; Anthropic counted with {ENCODING} (its "
          "tokenizer is not public); prices from third-party copies of the providers' pages, not the live pages.")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cache.json"
    path.write_text(json.dumps({"prices": PRICES, "encoding": ENCODING, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
