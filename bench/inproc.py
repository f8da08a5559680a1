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
"""

from __future__ import annotations

import gc
import time
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


def _request(model: str) -> AssembleRequest:
    return AssembleRequest.model_validate({
        "request_id": "inproc", "org_id": "acme", "agent_id": "support-bot", "model": model,
        "query": "The customer asks where their invoice from October is.",
        "recent_messages": [{"role": "user", "content": "Hi, I was charged twice for October."},
                            {"role": "assistant", "content": "Let me check that for you."},
                            {"role": "user", "content": "The customer asks where their invoice from October is."}],
        "deadline_ns": time.time_ns() + 3_600_000_000_000,
    })


def _chat_request(model: str) -> AssembleRequest:
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
    req = _request(model)
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

    hs, _ = _measure(warm_cat, policy, _chat_request(model), retrieval, iterations, warmup)
    out["chat_warm"] = {"iterations": iterations, **hs.summary(("wall", *STAGES))}

    cold_cat = Catalog.load(settings.catalog_path, cache_entries=0)
    cold_cat.warm_up()  # BPE vocabularies loaded: "cold" is the count cache, not the process
    hs, _ = _measure(cold_cat, policy, req, retrieval, cold_iterations, min(warmup, 3))
    out["cold"] = {"iterations": cold_iterations, **hs.summary(("wall", *STAGES))}
    return out
