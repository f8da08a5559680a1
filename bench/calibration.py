"""``python -m bench.calibration``: budget over-charge before and after usage-report calibration.

Why (docs/assembly.md "Calibrated token counts"): families without an offline vocabulary are
charged a conservative estimate, so real tokens are left unused. This simulates a provider whose
true counts the service cannot see: the catalog entry (default ``mistral-small-3``) says
*estimate*, while the "provider" counts every emitted prompt exactly with o200k by the same
message rules (``pipeline.counting.chat_count``). Conversations of varied real text (the token corpus,
the demo memories, the README and spec prose, generated tool-using turns) from a few hundred
tokens to 2.5x the window go through the real pipeline, with the demo memories as retrieval.

Each conversation is assembled twice: by the service with today's rules (``before``) and by the
service with the calibration learned so far (``after``); only ``after``'s prompts are reported,
in batches through the real Redis sketch (``worker.calibration_store``: the worker's flush and
refresh), so ``after`` runs uncalibrated until the key has ``--min-samples``. Reported per rule:
the median and p10/p90/p99 of the over-charge (charged / true - 1) and the number of prompts whose
true count exceeded window - response reserve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.lib.percentiles import median, percentile
from bench.lib.tables import table
from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.counting.calibration import Calibration, bucket_of, decay_per_sample
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse
from ibex_context.worker import calibration_store as store

ROOT = Path(__file__).resolve().parent.parent
TRUTH = "o200k"  # the hidden provider tokenizer
ORG = "bench"
TOOLS = [{"type": "function", "function": {"name": "lookup_invoice", "description": "Find an invoice by number",
                                           "parameters": {"type": "object", "properties": {
                                               "invoice": {"type": "string", "description": "the number"}}}}}]


def text_pool() -> list[str]:
    """Real text: the token corpus, the demo memories, README and spec paragraphs."""
    pool = [t for t in json.loads((ROOT / "tests" / "data" / "token_corpus.json").read_text()) if t.strip()]
    for line in (ROOT / "memory" / "data" / "demo.jsonl").read_text().splitlines():
        rec = json.loads(line)
        pool.extend(v for k, v in rec.items() if k in ("content", "text") and isinstance(v, str))
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        pool.extend(p.strip() for p in doc.read_text().split("\n\n") if len(p.strip()) > 40)
    return pool


def demo_hits() -> list[MemoryHit]:
    recs = [json.loads(x) for x in (ROOT / "memory" / "data" / "demo.jsonl").read_text().splitlines()]
    mems = [r for r in recs if r.get("kind") == "memory" and r.get("org_id") == "acme"][:20]
    return [MemoryHit(f"m{i}", r["content"], r["category"], 0.95 - i / 50, r["confidence"], i + 1, "hot")
            for i, r in enumerate(mems)]


def conversation(rng: random.Random, pool: list[str], target_chars: int) -> list[dict[str, Any]]:
    """User/assistant turns (some tool calls) of pool text until about ``target_chars``."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are Acme Cloud's support agent."}]
    size, n = 0, 0
    while size < target_chars:
        text = " ".join(rng.choice(pool) for _ in range(rng.randint(1, 3)))
        n += 1
        if n % 7 == 0:
            call = {"id": f"call_{n}", "type": "function",
                    "function": {"name": "lookup_invoice", "arguments": json.dumps({"invoice": f"INV-{n}"})}}
            msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{n}", "content": text}]
        else:
            msgs.append({"role": "user" if msgs[-1]["role"] != "user" else "assistant", "content": text})
        size += len(text)
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": rng.choice(pool)})
    return msgs


def run_one(req: AssembleRequest, retrieval: Any, catalog: Catalog, cal: Calibration | None) -> AssembleResponse:
    return assemble(req, retrieval, Engine(catalog, Policy()), nonce="0" * 32, calibration=cal)


def truth(resp: AssembleResponse, catalog: Catalog, model: str) -> int:
    """What the hidden provider counts for the emitted prompt."""
    assert resp.messages is not None
    return cc.openai_prompt_tokens(resp.messages, TOOLS, catalog.counter(TRUTH), model=model)


Row = tuple[int, int, int, bool]  # (charged, true, window - reserve, history trimmed to fit)


def figures(rows: list[Row]) -> dict[str, Any]:
    """Over-charge quantiles, over-window count, and how full the trimmed prompts really were."""
    over = sorted(c / t - 1 for c, t, _, _ in rows)
    full = sorted(t / limit for _, t, limit, trimmed in rows if trimmed)

    def q(p: float) -> float:
        return percentile(over, p * 100)

    return {"n": len(rows), "median": median(over), "p10": q(0.10), "p90": q(0.90), "p99": q(0.99),
            "over_window": sum(1 for _, t, limit, _ in rows if t > limit), "trimmed": len(full),
            "trimmed_fill_median": median(full) if full else None, "fill_max": max(full) if full else None}


async def simulate(args: argparse.Namespace) -> dict[str, Any]:
    catalog, pool, rng = Catalog.load(), text_pool(), random.Random(args.seed)
    spec = catalog.model(args.model)
    retrieval = offline_result(directive="Answer billing questions precisely and briefly.", hot=demo_hits(), cold=[])
    redis_server = EmbeddedRedis()
    redis_server.start()
    from redis.asyncio import Redis

    r = Redis.from_url(redis_server.url)
    before: list[Row] = []
    after: list[Row] = []
    calibrated: list[Row] = []
    cal: Calibration | None = None
    batch: Counter[int] = Counter()
    refused = 0
    sketch = store.SketchPolicy(decay_per_sample(args.window))
    t0 = time.perf_counter()
    try:
        for i in range(args.n):
            # log-uniform size: a few hundred tokens up to 2.5x the window (about 4 characters a token)
            chars = int(1200 * (spec.context_window * 10 / 1200) ** rng.random())
            req = AssembleRequest.model_validate({
                "request_id": f"b{i}", "org_id": ORG, "agent_id": "a", "model": args.model, "query": "invoice",
                "format": "openai", "messages": conversation(rng, pool, chars), "tools": TOOLS, "deadline_ns": 1})
            for rows, use in ((before, None), (after, cal)):
                resp = run_one(req, retrieval, catalog, use)
                true = truth(resp, catalog, spec.name)
                assert resp.prompt_tokens is not None and resp.prompt_tokens_uncalibrated is not None
                rows.append((resp.prompt_tokens, true, spec.context_window - resp.budget.response_reserve,
                             bool(resp.history)))
            if use is not None:
                calibrated.append(after[-1])
            b = bucket_of(true / resp.prompt_tokens_uncalibrated)  # the proxy's report of after's prompt
            if b is None:
                refused += 1
            else:
                batch[b] += 1
            if (i + 1) % args.batch == 0:  # the worker's flush, then its refresh
                await store.apply_batch(r, ORG, spec.name, batch, sketch, refused=refused)
                batch, refused = Counter(), 0
                latest = await store.read(r, ORG, spec.name, quantile=args.quantile)
                cal = latest if latest is not None and latest.active(args.min_samples) else None
            if args.progress and (i + 1) % 1000 == 0:
                print(f"  {i + 1}/{args.n} ({time.perf_counter() - t0:.0f} s)", flush=True)
        final = await store.read(r, ORG, spec.name, quantile=args.quantile)
    finally:
        await r.aclose()
        redis_server.close()
    return {"model": spec.name, "family": spec.family.name, "window": spec.context_window, "n": args.n,
            "elapsed_s": round(time.perf_counter() - t0, 1), "before": figures(before), "after": figures(after),
            "after_calibrated_only": figures(calibrated) if calibrated else None,
            "final_sketch": None if final is None else {
                "samples": round(final.samples, 1), "ratio_p50": final.median, "ratio_q": final.ratio,
                "ratio_max": final.top, "accepted": final.accepted, "refused": final.refused}}


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    pct = "{:+.1%}".format
    rows = []
    for name, key in (("before (catalog rule)", "before"), ("after (all, incl. warm-up)", "after"),
                      ("after (calibrated assemblies)", "after_calibrated_only")):
        f = res[key]
        if f is not None:
            fill = "-" if f["trimmed_fill_median"] is None else f"{f['trimmed_fill_median']:.1%} / {f['fill_max']:.1%}"
            rows.append([name, f["n"], pct(f["median"]), pct(f["p10"]), pct(f["p90"]), pct(f["p99"]),
                         f["over_window"], f["trimmed"], fill])
    lines = [f"# bench.calibration: {res['n']} assemblies, {res['model']} ({res['family']}, window {res['window']}), "
             f"hidden truth {TRUTH} exact, quantile {args.quantile}, min samples {args.min_samples}, "
             f"window {args.window} samples, {res['elapsed_s']} s", "",
             *table(["rule", "prompts", "over-charge median", "p10", "p90", "p99", "true > window - reserve",
                     "trimmed to fit", "trimmed: true / (window - reserve), median / max"], rows),
             "", f"final sketch: {res['final_sketch']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="assemblies (default 10000)")
    ap.add_argument("--model", default="mistral-small-3", help="a catalog model of an estimate family")
    ap.add_argument("--quantile", type=float, default=0.995)
    ap.add_argument("--min-samples", type=int, default=200)
    ap.add_argument("--window", type=int, default=2000, help="samples the decaying sketch follows")
    ap.add_argument("--batch", type=int, default=50, help="reports per flush/refresh")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out"), help="directory for calibration.json/.md")
    args = ap.parse_args(argv)
    res = asyncio.run(simulate(args))
    text = report(res, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(res, indent=2))
    (args.out / "calibration.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
