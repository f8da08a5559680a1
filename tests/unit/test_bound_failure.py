"""The emitted prompt never exceeds window - response reserve, even when a per-memory bound lies.

A line cache that prices every memory at 0 tokens makes the packer take them all, the repacks
cannot shed any (a 0-token memory fits every budget), and the final check must drop memories
until the prompt the caller gets fits, with ``packed`` naming exactly the memories rendered.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting.count import LineCache
from ibex_context.pipeline.counting.tokens import TokenCounter
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import AssembleRequest

WINDOW = 20000


def _catalog() -> Catalog:
    data = json.loads((Path(__file__).resolve().parents[2] / "pipeline" / "budget" / "catalog.json").read_text("utf-8"))
    data["models"]["claude-sonnet-4"]["context_window"] = WINDOW
    return Catalog(data)


class LyingLines(LineCache):
    """Every memory line priced at 0 tokens: a per-memory bound that is wrong."""

    def cost(self, h: MemoryHit, counter: TokenCounter) -> int:
        return 0


def _hits(n: int, words: int) -> list[MemoryHit]:
    return [MemoryHit(f"m{i:02d}", " ".join(f"fact{i}-{k}" for k in range(words)), "fact", 0.9 - i / 200, 0.8, i + 1,
                      "hot") for i in range(n)]


def _ids_in(text: str) -> list[str]:
    return re.findall(r'<memory id="([^"]+)"', text)


def test_a_lying_bound_never_yields_an_over_window_or_inconsistent_reply() -> None:
    catalog = _catalog()
    spec = catalog.model("claude-sonnet-4")
    messages: list[Any] = [{"role": "user", "content": "What happened in October?"}]
    req = AssembleRequest(request_id="r", org_id="acme", agent_id="bot", model=spec.name, query="October",
                          format="anthropic", messages=messages, deadline_ns=1)
    retrieval = offline_result(directive="Answer briefly.", hot=_hits(40, 60), cold=[], hot_cap=70, cold_cap=70)
    resp = assemble(req, retrieval, Engine(catalog, Policy(), lines=LyingLines()))
    limit = WINDOW - resp.budget.response_reserve
    assert resp.prompt_tokens is not None and resp.prompt_tokens <= limit
    assert resp.messages is not None
    block = "".join(b["text"] for m in resp.messages for b in m["content"]
                    if isinstance(b, dict) and b.get("type") == "text")
    packed = [p.memory_id for p in resp.packed]
    assert packed, "the test must keep some memories to check what is rendered"
    assert len(packed) < 40, "the lie must have forced memories out"
    assert _ids_in(block) == packed
    memories = next(s.text for s in resp.sections if s.name == "memories")
    assert _ids_in(memories) == packed
    assert resp.packer.total_tokens == sum(p.tokens for p in resp.packed)
    decided = {d.memory_id: d.decision for d in resp.decisions}
    assert all(decided[m] == "packed" for m in packed)
    assert sum(d == "excluded_budget" for d in decided.values()) == 40 - len(packed)
