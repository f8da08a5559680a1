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
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.lib.percentiles import median, percentiles
from bench.lib.stack import started_stack
from bench.lib.tables import table
from bench.litellm_rig import LiteLLMProxy, Upstream, proxy_config
from ibex_context.client import SyncClient
from ibex_context.client.integrations.litellm_core import last_user_text

OUT = Path(__file__).resolve().parent / "out" / "litellm.json"
KEYS = {"sk-bench": {"metadata": {"ibex_org": "acme", "ibex_agent": "support-bot"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup_invoice", "description": "Find an invoice.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TURN = [
    {"role": "system", "content": "You are Acme's support assistant."},
    {"role": "user", "content": "Is invoice 42 paid?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "lookup_invoice", "arguments": "{\"q\": \"42\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "invoice 42: 120 EUR, sent 3 October"},
    {"role": "user", "content": "When will my invoice be paid and can I pay by card?"},
]
STACK_ENV = {"IBEX_CONTEXT_TIMEOUT": "100", "IBEX_CONTEXT_DEADLINE_MS": "100", "IBEX_HOT_TIMEOUT_MS": "50",
             "IBEX_COLD_TIMEOUT_MS": "80", "IBEX_DIRECTIVE_TIMEOUT_MS": "20"}


def _call(client: httpx.Client, url: str, headers: dict[str, str]) -> tuple[float, httpx.Response]:
    body = {"model": "gpt-4o", "messages": TURN, "tools": TOOLS}
    t0 = time.perf_counter()
    resp = client.post(url, json=body, headers=headers)
    ms = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered {resp.status_code}: {resp.text[:300]}")
    return ms, resp


def _assemble(ctx: SyncClient) -> tuple[float, str]:
    """The assembly the hook makes for this call, straight from the client library (ms, outcome)."""
    t0 = time.perf_counter()
    resp = ctx.assemble_or_degrade(org_id="acme", agent_id="support-bot", model="gpt-4o", format="openai",
                                   query=last_user_text(TURN, 2000), messages=TURN, tools=TOOLS, timeout=0.1)
    return (time.perf_counter() - t0) * 1000, "degraded" if resp.degraded else "assembled"


def measure(urls: dict[str, str], endpoint: str, rounds: int, warmup: int, seed: int) -> dict[str, Any]:
    """Per-arm latencies (ms) over ``rounds`` rounds, arms in random order each round."""
    rng = random.Random(seed)
    auth = {"authorization": "Bearer sk-bench"}
    lat: dict[str, list[float]] = {arm: [] for arm in [*urls, "assemble"]}
    outcome: dict[str, int] = {}
    with httpx.Client(timeout=30) as client, SyncClient(endpoint) as ctx:
        ctx.prepare_fallback()
        for i in range(warmup + rounds):
            arms = list(lat)
            rng.shuffle(arms)
            for arm in arms:
                if arm == "assemble":
                    ms, state = _assemble(ctx)
                else:
                    ms, resp = _call(client, urls[arm], auth)
                    state = resp.headers.get("x-ibex-context", "missing")
                if i >= warmup:
                    lat[arm].append(ms)
                    if arm in ("hook", "assemble"):
                        outcome[f"{arm} {state}"] = outcome.get(f"{arm} {state}", 0) + 1
    return {"latency_ms": lat, "outcomes": outcome}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    lat = {k: np.asarray(v) for k, v in res["latency_ms"].items()}
    pct = {k: {**percentiles(v, (50, 99)), "n": len(v)} for k, v in lat.items()}
    paired = lat["hook"] - lat["no_hook"]
    return {"arms": pct, "added_p50_ms": pct["hook"]["p50"] - pct["no_hook"]["p50"],
            "added_p99_ms": pct["hook"]["p99"] - pct["no_hook"]["p99"],
            "added_median_paired_ms": median(paired),
            "outcomes": res["outcomes"]}


def run(rounds: int, warmup: int, seed: int, workers: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ibex-bench-litellm-"))
    with started_stack(workers=workers, env=STACK_ENV, log_dir=work / "stack", seed=True) as stack:
        upstream = Upstream(work)
        proxies: list[LiteLLMProxy] = []
        try:
            # A degraded reply goes out as it is (counted in the outcomes), never a refusal: the
            # bench measures what the hook adds to a call, whatever the service answered.
            hook_cfg = {"endpoints": [stack.frontend], "orgs": {"acme": {}}, "timeout_ms": 100,
                        "on_degraded": "pass"}
            (work / "hook.json").write_text(json.dumps(hook_cfg))
            models = {"gpt-4o": "gpt-4o"}
            for name, hook in (("with-hook", True), ("without-hook", False)):
                proxies.append(LiteLLMProxy(work / name, proxy_config(upstream, models, hook=hook), KEYS,
                                            env={"IBEX_LITELLM_CONFIG": str(work / "hook.json")}))
            urls = {"hook": f"{proxies[0].url}/v1/chat/completions",
                    "no_hook": f"{proxies[1].url}/v1/chat/completions",
                    "upstream": f"{upstream.base}/v1/chat/completions"}
            return summarize(measure(urls, stack.frontend, rounds, warmup, seed))
        finally:
            for p in proxies:
                p.stop()
            upstream.stop()


def report(s: dict[str, Any]) -> str:
    names = {"upstream": "upstream directly (floor)", "no_hook": "LiteLLM, no hook", "hook": "LiteLLM + ibex hook",
             "assemble": "the same assembly from the client library alone"}
    rows = [[names[k], f"{v['p50']:.2f}", f"{v['p99']:.2f}", v["n"]] for k, v in s["arms"].items()]
    rows.append(["added by the hook (difference)", f"{s['added_p50_ms']:.2f}", f"{s['added_p99_ms']:.2f}", ""])
    lines = table(["path", "p50 ms", "p99 ms", "calls"], rows)
    lines.append("")
    lines.append(f"median per-round difference hook - no hook: {s['added_median_paired_ms']:.2f} ms; "
                 f"outcomes: {s['outcomes']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    s = run(args.rounds, args.warmup, args.seed, args.workers)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(s, indent=1))
    print(report(s))


if __name__ == "__main__":
    main()
