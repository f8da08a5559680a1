"""``python -m bench.litellm``: the latency the ibex-context hook adds to a call through LiteLLM.

Why: a proxy engineer adopting the hook needs to know what it costs per call. One run starts the
stack (embedded Redis, memory service, broker, workers; demo data seeded), the local
OpenAI-compatible upstream (``bench.litellm_upstream``) and two real LiteLLM proxies in front of the
same upstream: one with the hook in its callbacks, one without. Each round sends the same
tool-using chat completion through both, through nothing (the upstream directly, the floor), and
makes the same assembly straight from the client library (what the hook waits for), in random
order, one at a time (closed loop, keep-alive connections); latency is the client's wall time per
call. Reported: p50 / p99 of each arm and what the hook adds (difference of the percentiles, and
the median of the per-round differences). Writes ``bench/out/litellm.json``.

``--summaries``: what compaction summaries (the hook's ``summaries`` config, docs/litellm.md)
cost on the call path. The call becomes a long conversation (``--turns`` short tool-using turns,
≈ 65 tokens each) on gpt-4 (8,192 tokens), trimmed on every call, and three more proxies join,
each a copy of the hooked one plus ``summaries`` (``as_memory`` off, ``timeout_s``
``SUMMARY_TIMEOUT_S``) whose summary model has an upstream of its own: answering (``digest``),
failing (``PUT /_summary fail``: HTTP 500) or hanging (``hang``: the timeout ends each summary).
Every call carries its own ``x-litellm-session-id``, so on the summaries arms each call is a new
conversation with no stored summary: each one is due, and its success starts a summary in the
background (the most background work the hook makes). Each arm is also reported against the hook
without summaries (the same request and hook config but for ``summaries``), with the hook's
counters (``Summarizer.stats``, read from each proxy on ``SIGUSR1`` once the rounds are over and
the summaries have ended) and the summaries the service stored (Redis), over all calls, the
warm-up included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from bench.lib.percentiles import median, percentiles
from bench.lib.stack import started_stack
from bench.lib.tables import table
from bench.litellm_rig import LiteLLMProxy, Upstream, proxy_config
from ibex_context.client import SyncClient
from ibex_context.client.integrations.litellm.core import last_user_text
from ibex_context.shared.stores.keys import summary_key

OUT = Path(__file__).resolve().parent / "out" / "litellm.json"
KEYS = {"sk-bench": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup_invoice", "description": "Find an invoice.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TURN: list[dict[str, Any]] = [
    {"role": "system", "content": "You are Acme's support assistant."},
    {"role": "user", "content": "Is invoice 42 paid?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "lookup_invoice", "arguments": "{\"q\": \"42\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "invoice 42: 120 EUR, sent 3 October"},
    {"role": "user", "content": "When will my invoice be paid and can I pay by card?"},
]
STACK_ENV = {"IBEX_CONTEXT_TIMEOUT": "100", "IBEX_CONTEXT_DEADLINE_MS": "100", "IBEX_HOT_TIMEOUT_MS": "50",
             "IBEX_COLD_TIMEOUT_MS": "80", "IBEX_DIRECTIVE_TIMEOUT_MS": "20"}
# proxy model name -> deployment; "summarizer" is the summary model (its own upstream per mode)
MODELS = {"gpt-4o": "gpt-4o", "gpt-4": "gpt-4", "summarizer": "gpt-4o-mini"}
SUMMARY_ARMS = {"summaries_ok": "digest", "summaries_fail": "fail", "summaries_hang": "hang"}
SUMMARY_TIMEOUT_S = 2.0
HOOK_ARMS = ("hook", *SUMMARY_ARMS)
CLEAR_EVERY = 20  # rounds between forgetting what the upstreams recorded (bounded memory)


@dataclass(frozen=True, slots=True)
class Call:
    """The request every arm sends; ``session``: each call names its own conversation."""

    model: str
    messages: list[dict[str, Any]]
    session: str | None = None  # the x-litellm-session-id prefix, when set


def long_conversation(turns: int) -> list[dict[str, Any]]:
    """A support session of ``turns`` short tool-using turns (question, lookup, result, answer)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are Acme's support assistant."}]
    for n in range(turns):
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "lookup_invoice", "arguments": json.dumps({"q": str(n)})}}
        out += [{"role": "user", "content": f"Is invoice {n} paid?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{n}", "content": f"invoice {n}: {n % 300} EUR, sent 3 October"},
                {"role": "assistant", "content": f"Invoice {n} is paid."}]
    out.append({"role": "user", "content": "When will my last invoice be paid and can I pay by card?"})
    return out


def _call(client: httpx.Client, url: str, headers: dict[str, str], call: Call) -> tuple[float, httpx.Response]:
    body = {"model": call.model, "messages": call.messages, "tools": TOOLS}
    t0 = time.perf_counter()
    resp = client.post(url, json=body, headers=headers)
    ms = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
    return ms, resp


def _assemble(ctx: SyncClient, call: Call) -> tuple[float, str]:
    """The assembly the hook makes for this call, straight from the client library (ms, outcome)."""
    t0 = time.perf_counter()
    resp = ctx.assemble_or_degrade(org_id="acme", agent_id="support-bot", model=call.model, format="openai",
                                   query=last_user_text(call.messages, 2000), messages=call.messages, tools=TOOLS,
                                   timeout=0.1)
    return (time.perf_counter() - t0) * 1000, "degraded" if resp.degraded else "assembled"


def session_id(call: Call, arm: str, i: int) -> dict[str, str]:
    """The call's own conversation id (LiteLLM's ``x-litellm-session-id``), when the call has one."""
    return {} if call.session is None else {"x-litellm-session-id": f"{call.session}-{arm.replace('_', '-')}-{i}"}


def measure(urls: dict[str, str], endpoint: str, call: Call, rounds: int, warmup: int, seed: int,
            between: Callable[[int], None] = lambda i: None) -> dict[str, Any]:
    """Per-arm latencies (ms) over ``rounds`` rounds, arms in random order each round; ``between``
    runs before each round, untimed."""
    rng = random.Random(seed)
    auth = {"authorization": "Bearer sk-bench"}
    lat: dict[str, list[float]] = {arm: [] for arm in [*urls, "assemble"]}
    outcome: dict[str, int] = {}
    with httpx.Client(timeout=30) as client, SyncClient(endpoint) as ctx:
        ctx.prepare_fallback()
        for i in range(warmup + rounds):
            between(i)
            arms = list(lat)
            rng.shuffle(arms)
            for arm in arms:
                if arm == "assemble":
                    ms, state = _assemble(ctx, call)
                else:
                    ms, resp = _call(client, urls[arm], {**auth, **session_id(call, arm, i)}, call)
                    state = resp.headers.get("x-ibex-context", "missing")
                    if "x-ibex-context-summary-due" in resp.headers:
                        state += ", summary due"
                if i >= warmup:
                    lat[arm].append(ms)
                    if arm in (*HOOK_ARMS, "assemble"):
                        outcome[f"{arm} {state}"] = outcome.get(f"{arm} {state}", 0) + 1
    return {"latency_ms": lat, "outcomes": outcome}


def _added(lat: dict[str, np.ndarray], pct: dict[str, dict[str, float]], arm: str, base: str) -> dict[str, float]:
    return {"added_p50_ms": pct[arm]["p50"] - pct[base]["p50"], "added_p99_ms": pct[arm]["p99"] - pct[base]["p99"],
            "added_median_paired_ms": median(lat[arm] - lat[base])}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    lat = {k: np.asarray(v) for k, v in res["latency_ms"].items()}
    pct = {k: {**percentiles(v, (50, 99)), "n": len(v)} for k, v in lat.items()}
    out = {"arms": pct, **_added(lat, pct, "hook", "no_hook"), "outcomes": res["outcomes"]}
    arms = [a for a in SUMMARY_ARMS if a in lat]
    if arms:
        out["summaries"] = {a: _added(lat, pct, a, "hook") for a in arms}
    return out


def _settled(proxies: dict[str, LiteLLMProxy], wait_s: float) -> dict[str, dict[str, int]]:
    """Each summaries proxy's hook counters once every summary it started has ended (or ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        got = {arm: p.hook_stats() for arm, p in proxies.items()}
        ended = all(s.get("summary_started", 0) <= sum(s.get(k, 0) for k in
                                                       ("summary_sent", "summary_not_sent", "summary_failed"))
                    for s in got.values())
        if ended or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _stored(redis_url: str, tag: str) -> dict[str, int]:
    """Summaries the service stored per arm (their keys carry the arm's session ids)."""
    r = redis.Redis.from_url(redis_url)
    try:
        pattern = summary_key("acme", "support-bot", f"s:{tag}-x").removesuffix("-x")
        return {arm: sum(1 for _ in r.scan_iter(f"{pattern}-{arm.replace('_', '-')}-*", count=1000))
                for arm in SUMMARY_ARMS}
    finally:
        r.close()


def _hook_cfg(work: Path, name: str, frontend: str, summaries: bool) -> Path:
    # A degraded reply goes out as it is (counted in the outcomes), never a refusal: the bench
    # measures what the hook adds to a call, whatever the service answered.
    cfg: dict[str, Any] = {"endpoints": [frontend], "orgs": {"acme": {}}, "timeout_ms": 100, "on_degraded": "pass"}
    if summaries:
        cfg["summaries"] = {"model": "summarizer", "as_memory": False, "timeout_s": SUMMARY_TIMEOUT_S}
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _upstream(work: Path, name: str, mode: str = "digest") -> Upstream:
    (work / name).mkdir(parents=True, exist_ok=True)
    up = Upstream(work / name)
    up.summary_mode(mode)
    return up


def _proxies(work: Path, frontend: str, upstream: Upstream, arms: dict[str, str | None],
             done: contextlib.ExitStack) -> tuple[dict[str, LiteLLMProxy], list[Upstream]]:
    """One proxy per arm: ``None`` no hook, "" the hook, else the hook with summaries whose model
    answers in that mode (an upstream of its own); and those upstreams."""
    out: dict[str, LiteLLMProxy] = {}
    own: list[Upstream] = []
    for arm, mode in arms.items():
        upstreams = {}
        if mode:
            upstreams["summarizer"] = _upstream(work, f"upstream-{arm}", mode)
            done.callback(upstreams["summarizer"].stop)
            own.append(upstreams["summarizer"])
        env = ({} if mode is None else
               {"IBEX_LITELLM_CONFIG": str(_hook_cfg(work, f"hook-{arm}", frontend, summaries=bool(mode)))})
        p = LiteLLMProxy(work / arm, proxy_config(upstream, MODELS, hook=mode is not None, upstreams=upstreams),
                         KEYS, env=env, stats_file=None if mode is None else work / arm / "hook-stats.json")
        done.callback(p.stop)
        out[arm] = p
    return out, own


def run(rounds: int, warmup: int, seed: int, workers: int, turns: int | None) -> dict[str, Any]:
    """One run; ``turns``: the long conversation and the summaries arms (``--summaries``)."""
    work = Path(tempfile.mkdtemp(prefix="ibex-bench-litellm-"))
    tag = "b" + secrets.token_hex(4)
    call = (Call("gpt-4o", TURN) if turns is None else Call("gpt-4", long_conversation(turns), session=tag))
    arms: dict[str, str | None] = {"hook": "", "no_hook": None, **(SUMMARY_ARMS if turns is not None else {})}
    with started_stack(workers=workers, env=STACK_ENV, log_dir=work / "stack", seed=True) as stack, \
            contextlib.ExitStack() as done:
        upstream = _upstream(work, "upstream")
        done.callback(upstream.stop)
        proxies, own = _proxies(work, stack.frontend, upstream, arms, done)
        ups = [upstream, *own]
        urls = {arm: f"{p.url}/v1/chat/completions" for arm, p in proxies.items()}
        urls["upstream"] = f"{upstream.base}/v1/chat/completions"

        def between(i: int) -> None:
            if i % CLEAR_EVERY == 0:
                for u in ups:
                    u.clear()

        s = summarize(measure(urls, stack.frontend, call, rounds, warmup, seed, between))
        s["request"] = {"model": call.model, "messages": len(call.messages), "tools": len(TOOLS),
                        "chars": len(json.dumps(call.messages))}
        if turns is not None:
            stats = _settled({a: proxies[a] for a in SUMMARY_ARMS}, SUMMARY_TIMEOUT_S + 20)
            stored = _stored(str(stack.redis_url), tag)
            for arm in SUMMARY_ARMS:
                s["summaries"][arm].update(calls=warmup + rounds, hook_stats=stats[arm], stored=stored[arm])
        return s


NAMES = {"upstream": "upstream directly (floor)", "no_hook": "LiteLLM, no hook", "hook": "LiteLLM + ibex hook",
         "summaries_ok": "hook + summaries (model answers)", "summaries_fail": "hook + summaries (model fails)",
         "summaries_hang": f"hook + summaries (model hangs, timeout {SUMMARY_TIMEOUT_S:g} s)",
         "assemble": "the same assembly from the client library alone"}


def _summaries_report(s: dict[str, Any]) -> list[str]:
    rows = []
    for arm, v in s["summaries"].items():
        st = v.get("hook_stats", {})
        rows.append([NAMES[arm], f"{v['added_p50_ms']:+.2f}", f"{v['added_p99_ms']:+.2f}",
                     f"{v['added_median_paired_ms']:+.2f}", v.get("calls", ""), st.get("summary_started", 0),
                     st.get("summary_sent", 0), v.get("stored", ""), st.get("summary_failed", 0)])
    head = ["vs hook without summaries", "p50 ms", "p99 ms", "median per-round ms", "calls", "started", "sent",
            "stored", "failed"]
    return ["", *table(head, rows)]


def report(s: dict[str, Any]) -> str:
    rows = [[NAMES[k], f"{v['p50']:.2f}", f"{v['p99']:.2f}", v["n"]] for k in NAMES
            if (v := s["arms"].get(k)) is not None]
    added = ["added by the hook (difference)", f"{s['added_p50_ms']:.2f}", f"{s['added_p99_ms']:.2f}", ""]
    rows.insert(next(i for i, r in enumerate(rows) if r[0] == NAMES["hook"]) + 1, added)
    lines = table(["path", "p50 ms", "p99 ms", "calls"], rows)
    if "summaries" in s:
        lines += _summaries_report(s)
    lines.append("")
    lines.append(f"request: {s['request']}; median per-round difference hook - no hook: "
                 f"{s['added_median_paired_ms']:.2f} ms; outcomes: {s['outcomes']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--summaries", action="store_true",
                    help="a long conversation on gpt-4, plus the hook with summaries (model ok, failing, hanging)")
    ap.add_argument("--turns", type=int, default=200, help="the long conversation's turns (with --summaries)")
    args = ap.parse_args()
    s = run(args.rounds, args.warmup, args.seed, args.workers, args.turns if args.summaries else None)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(s, indent=1))
    print(report(s))


if __name__ == "__main__":
    main()
