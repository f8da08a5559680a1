"""The CPU pipeline with no transport (``inproc`` mode, docs/performance.md).

``pipeline.assemble.assemble`` (budget, scoring, packing, formatting and the response model) on a
``RetrievalResult`` from ``pipeline.selection.hits.offline_result`` with n = 70 candidates (20 hot + 50
cold) of realistic sizes, with a worker's line cache. Two token-count cache states:

* warm: one Catalog with the default cache, warmed by ``warmup`` calls on the same candidates
  (the steady state of a worker serving one agent: memories repeat across requests);
* cold: a Catalog with ``cache_entries=0``, so every count is a full BPE pass (a worker seeing
  every memory for the first time). BPE vocabularies are loaded before timing in both cases.

``wall`` is ``perf_counter_ns`` around the call; the per-stage figures are the pipeline's own
``timings_us``. Nothing is asserted.

``python -m bench.inproc [--baseline DIR ...] [--rounds 40] [--iterations 200]`` compares checkouts
on the warm pipeline in one sitting: the same workload (this checkout's request and hits, as plain
data) runs in one process per checkout (``bench.lib.inproc_child``, each built with that
checkout's own models and pipeline, imported through ``bench.lib.checkout``), the processes taking
turns round by round in rotated order, so a burst of load from elsewhere lands on all of them
alike. Each round is ``--iterations`` calls per process; the table gives, per checkout, the median
over rounds of each round's p50, the spread of those p50s, the median per-round difference to this
checkout, the stages' p50s by the same rule, and whether its responses are the same (digest of
the response with timings, worker id and nonce taken out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import WORKER_STAGES, Histograms
from bench.workload import candidate_hits
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting.count import LineCache
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse

STAGES = tuple(s for s in WORKER_STAGES if s != "retrieval")


def request_data(model: str) -> dict[str, Any]:
    """The simple-form request, without its deadline."""
    return {
        "request_id": "inproc", "org_id": "acme", "agent_id": "support-bot", "model": model,
        "query": "The customer asks where their invoice from October is.",
        "recent_messages": [{"role": "user", "content": "Hi, I was charged twice for October."},
                            {"role": "assistant", "content": "Let me check that for you."},
                            {"role": "user", "content": "The customer asks where their invoice from October is."}],
    }


def simple_request(model: str) -> AssembleRequest:
    return AssembleRequest.model_validate({**request_data(model), "deadline_ns": time.time_ns() + 3_600_000_000_000})


def chat_request(model: str) -> AssembleRequest:
    """A 20-message tool-using OpenAI conversation (docs/assembly.md "Chat-native assembly"): a system
    message, four rounds of a question, an assistant tool call, its result and an answer, then the
    current turn: a question, a tool call and its result (the agent loop mid-turn)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are Acme Cloud's support agent."}]
    for i in range(5):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "lookup_invoice", "arguments": f'{{"month": "2026-{i + 6:02d}"}}'}}
        messages += [
            {"role": "user", "content": f"Where is my invoice for month {i + 6}? I was charged twice."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"invoice #{40 + i} sent on {i + 3} October"},
            {"role": "assistant",
             "content": f"Invoice #{40 + i} was sent on {i + 3} October; the double charge is refunded."},
        ]
    messages = messages[:20]
    tools = [{"type": "function", "function": {"name": "lookup_invoice", "description": "Find an invoice by month",
                                               "parameters": {"type": "object",
                                                              "properties": {"month": {"type": "string"}}}}}]
    return AssembleRequest.model_validate({
        "request_id": "inproc-chat", "org_id": "acme", "agent_id": "support-bot", "model": model,
        "query": "The customer asks where their invoice from October is.", "format": "openai",
        "messages": messages, "tools": tools, "deadline_ns": time.time_ns() + 3_600_000_000_000,
    })


def _measure(catalog: Catalog, policy: Policy, req: AssembleRequest, retrieval: Any, iterations: int,
             warmup: int) -> tuple[Histograms, Any]:
    hs = Histograms()
    resp = None
    engine = Engine(catalog, policy, lines=LineCache(), worker_id="inproc")  # one worker's line cache, kept

    def once() -> AssembleResponse:
        return assemble(req, retrieval, engine)

    for _ in range(warmup):
        once()
    gc.collect()
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        resp = once()
        hs.record("wall", (time.perf_counter_ns() - t0) / 1000)
        for k in STAGES:
            hs.record(k, resp.timings_us.get(k, 0))
    return hs, resp


def run(*, iterations: int = 300, cold_iterations: int = 60, warmup: int = 20, model: str = "gpt-4o",
        n_hot: int = 20, n_cold: int = 50, seed: int = 70) -> dict[str, Any]:
    """Warm- and cold-cache latency of the CPU pipeline at ``n_hot + n_cold`` candidates (µs)."""
    settings = Settings()
    directive, hot, cold = candidate_hits(n_hot, n_cold, seed=seed)
    retrieval = offline_result(directive=directive, hot=hot, cold=cold, hot_cap=n_hot, cold_cap=n_cold)
    req = simple_request(model)
    n_candidates = len({h.memory_id for h in (*retrieval.hot, *retrieval.cold)})  # distinct memories
    out: dict[str, Any] = {"model": model, "n_candidates": n_candidates, "n_hot": n_hot,
                           "n_cold": n_cold, "candidate_chars": sum(len(h.content) for h in (*hot, *cold))}

    warm_cat = Catalog.load(settings.catalog_path)
    warm_cat.warm_up()
    policy = Policy.from_settings(settings)
    hs, resp = _measure(warm_cat, policy, req, retrieval, iterations, warmup)
    counter = warm_cat.counter(warm_cat.model(model).family.name)
    out["warm"] = {"iterations": iterations, "cache_hits": counter.hits, "cache_misses": counter.misses,
                   **hs.summary(("wall", *STAGES))}
    if resp is not None:
        out["packed"] = len(resp.packed)
        out["packer_path"] = resp.packer.path
        out["candidate_tokens"] = sum(d.tokens or 0 for d in resp.decisions
                                      if d.decision in ("packed", "excluded_budget"))
        out["token_budget"] = resp.budget.usable

    hs, _ = _measure(warm_cat, policy, chat_request(model), retrieval, iterations, warmup)
    out["chat_warm"] = {"iterations": iterations, **hs.summary(("wall", *STAGES))}

    cold_cat = Catalog.load(settings.catalog_path, cache_entries=0)
    cold_cat.warm_up()  # BPE vocabularies loaded: "cold" is the count cache, not the process
    hs, _ = _measure(cold_cat, policy, req, retrieval, cold_iterations, min(warmup, 3))
    out["cold"] = {"iterations": cold_iterations, **hs.summary(("wall", *STAGES))}
    return out


# The hit fields every checkout's MemoryHit takes (those ``candidate_hits`` sets).
HIT_FIELDS = ("memory_id", "content", "category", "similarity", "confidence", "rank", "source")
CHILD = Path(__file__).resolve().parent / "lib" / "inproc_child.py"
CHILD_STAGES = ("budget", "scoring", "packing", "formatting")


def workload(*, model: str = "gpt-4o", n_hot: int = 20, n_cold: int = 50, seed: int = 70) -> dict[str, Any]:
    """The warm measurement's request and hits as plain data, for any checkout's models."""
    directive, hot, cold = candidate_hits(n_hot, n_cold, seed=seed)
    return {"request": request_data(model), "directive": directive,
            "hot": [{f: getattr(h, f) for f in HIT_FIELDS} for h in hot],
            "cold": [{f: getattr(h, f) for f in HIT_FIELDS} for h in cold]}


def compare(arms: list[tuple[str, Path | None]], *, rounds: int, iterations: int) -> dict[str, list[dict[str, Any]]]:
    """Each arm's per-round results (``bench.lib.inproc_child``), the arms taking turns round by round."""
    from bench.lib.checkout import pythonpath

    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in arms}
    with tempfile.TemporaryDirectory(prefix="inproc-") as tmp:
        path = Path(tmp) / "workload.json"
        path.write_text(json.dumps(workload()), "utf-8")
        procs: list[tuple[str, subprocess.Popen[str]]] = []
        try:
            for name, checkout in arms:
                env = dict(os.environ)
                if checkout is not None:
                    env["PYTHONPATH"] = pythonpath(checkout)
                procs.append((name, subprocess.Popen([sys.executable, str(CHILD), str(path)], cwd=tmp, env=env,
                                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)))
            for name, proc in procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit(f"{name}: the pipeline did not start")
            for r in range(rounds):
                k = r % len(procs)
                for name, proc in procs[k:] + procs[:k]:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{iterations}\n")
                    proc.stdin.flush()
                    results[name].append(json.loads(proc.stdout.readline()))
        finally:
            for _, proc in procs:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=60)
    return results


def report(results: dict[str, list[dict[str, Any]]], against: str) -> list[str]:
    """The comparison table: medians over rounds of per-round p50s (ms)."""
    from bench.lib.percentiles import median, percentile
    from bench.lib.tables import table

    rows: list[list[Any]] = []
    ref = results[against]
    for name, runs in results.items():
        walls = [r["wall"] for r in runs]
        diff = [a["wall"] - b["wall"] for a, b in zip(runs, ref, strict=True)]
        digests = sorted({r["digest"] for r in runs})
        rows.append([name, f"{median(walls) / 1000:.3f}",
                     f"{percentile(walls, 10) / 1000:.3f}-{percentile(walls, 90) / 1000:.3f}",
                     "-" if name == against else f"{median(diff) / 1000:+.3f}",
                     *(f"{median([r[k] for r in runs]) / 1000:.3f}" for k in CHILD_STAGES),
                     ", ".join(digests)])
    return table(["checkout", "wall p50", "p10-p90 of rounds", f"against {against}",
                  *(f"{k} p50" for k in CHILD_STAGES), "response digest"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.inproc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, action="append", default=[], help="another checkout (repeatable)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds; every checkout runs once per round")
    ap.add_argument("--iterations", type=int, default=200, help="timed calls per checkout per round")
    args = ap.parse_args(argv)
    arms: list[tuple[str, Path | None]] = [(b.resolve().name, b.resolve()) for b in args.baseline]
    arms.append(("this", None))
    started = time.time()
    load = os.getloadavg()
    results = compare(arms, rounds=args.rounds, iterations=args.iterations)
    load_after = os.getloadavg()
    n = workload()
    print(f"Warm in-process pipeline, n = {len(n['hot']) + len(n['cold'])} candidates ({len(n['hot'])} hot + "
          f"{len(n['cold'])} cold), {args.rounds} rounds x {args.iterations} calls per checkout, interleaved; "
          f"ms, median over rounds of each round's p50 (load average {load[0]:.2f} before, "
          f"{load_after[0]:.2f} after, {time.time() - started:.0f} s):\n")
    print("\n".join(report(results, "this")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
