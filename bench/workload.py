"""What the bench sends: requests over the seeded demo tenants, and offline candidate sets.

Requests rotate over the demo dataset's (org, agent) pairs, a few queries each, three models from
two tokenizer families (o200k exact BPE, claude estimate) and 1-4 recent messages, drawn with a
fixed seed so runs are comparable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from bench.questions import FreshQuestions
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.models import AssembleRequest, Message

DEMO_DATA = Path(__file__).resolve().parent.parent / "memory" / "data" / "demo.jsonl"

AGENTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("acme", "support-bot"): ("The customer asks where their invoice from October is.",
                              "What do we know about the customer's contact preferences?",
                              "Customer reports the backup dashboard is slow; any history?"),
    ("globex", "support-bot"): ("Customer cannot log in after the SSO change.",
                                "Which plan is this account on and what did they ask last time?"),
    ("acme", "sales-assistant"): ("Prepare a renewal call: what matters to this account?",
                                  "Which discounts did we offer this customer before?"),
    ("acme", "devops-helper"): ("The nightly deploy failed again; what changed recently?",
                                "Who owns the staging database and how do we page them?"),
    ("globex", "research-agent"): ("Summarise what we know about competitor pricing.",
                                   "Which sources did the analyst trust last quarter?"),
    ("globex", "hr-helper"): ("An employee asks about parental leave policy.",
                              "How many vacation days carry over to next year?"),
}
MODELS = ("gpt-4o", "claude-sonnet-4", "gpt-4.1-mini")
CHAT = ("Hi, I need some help with my account.", "Sure, what seems to be the problem?",
        "The numbers on my last invoice look wrong and I was charged twice for the same month.",
        "Let me check that for you. Can you confirm the email address on the account?")


def request_templates(n: int = 64, *, seed: int = 9) -> list[AssembleRequest]:
    """``n`` valid requests; the load generator gives each send a fresh request_id and deadline."""
    rng = np.random.default_rng(seed)
    pairs = list(AGENTS)
    far = time.time_ns() + 3_600_000_000_000  # replaced by the client's own deadline on every send
    out = []
    for i in range(n):
        org, agent = pairs[i % len(pairs)]
        queries = AGENTS[(org, agent)]
        query = queries[int(rng.integers(len(queries)))]
        k = int(rng.integers(1, len(CHAT) + 1))
        msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": CHAT[j]} for j in range(k - 1)]
        msgs.append({"role": "user", "content": query})
        out.append(AssembleRequest.model_validate({
            "request_id": f"tmpl-{i}", "org_id": org, "agent_id": agent, "model": MODELS[i % len(MODELS)],
            "query": query, "recent_messages": msgs, "deadline_ns": far}))
    return out


class Requests(Sequence[AssembleRequest]):
    """The requests a target sends: ``nth(i)`` is the ``i``-th send's request (before its
    request_id and deadline are set). With ``new_questions`` every send asks a question from
    ``bench.questions`` never asked before in this process (query and newest user message), so the
    memory service embeds every query, as it does behind a proxy; otherwise the templates repeat
    and the service's query cache answers most embeddings."""

    def __init__(self, templates: Sequence[AssembleRequest], *, new_questions: bool = False) -> None:
        self.templates = list(templates)
        self._fresh = FreshQuestions() if new_questions else None

    @property
    def new_questions(self) -> bool:
        return self._fresh is not None

    def nth(self, i: int) -> AssembleRequest:
        tmpl = self.templates[i % len(self.templates)]
        if self._fresh is None:
            return tmpl
        q = self._fresh(tmpl.agent_id)
        return tmpl.model_copy(update={"query": q, "recent_messages": [*tmpl.recent_messages[:-1],
                                                                       Message(role="user", content=q)]})

    def __len__(self) -> int:
        return len(self.templates)

    def __getitem__(self, i: int) -> AssembleRequest:  # type: ignore[override]
        return self.templates[i]

    def __iter__(self) -> Iterator[AssembleRequest]:
        return iter(self.templates)


def as_requests(templates: Sequence[AssembleRequest]) -> Requests:
    return templates if isinstance(templates, Requests) else Requests(templates)


def demo_texts(path: Path = DEMO_DATA) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "memory":
                texts.append(str(row["content"]))
    return texts


def candidate_hits(n_hot: int = 20, n_cold: int = 50, *, seed: int = 70,
                   median_chars: int = 300) -> tuple[str, list[MemoryHit], list[MemoryHit]]:
    """A directive and ``n_hot`` + ``n_cold`` distinct memories of realistic sizes.

    Sizes are lognormal (median ``median_chars``, sigma 0.9, clipped to 40-4000 characters, i.e.
    roughly 10-1000 tokens), built from the demo dataset's sentences so the BPE sees real English.
    """
    rng = np.random.default_rng(seed)
    texts = demo_texts()
    sizes = np.clip(rng.lognormal(np.log(median_chars), 0.9, n_hot + n_cold), 40, 4000).astype(int)
    hits: list[MemoryHit] = []
    for i, size in enumerate(sizes):
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < size:
            parts.append(texts[int(rng.integers(len(texts)))])
        hot = i < n_hot
        hits.append(MemoryHit(
            memory_id=f"{'h' if hot else 'c'}{i:03d}", content=" ".join(parts)[: int(size)],
            category=("preference", "fact", "episode", "procedure")[i % 4],
            similarity=float(rng.uniform(0.70, 0.99)), confidence=float(rng.uniform(0.5, 1.0)),
            rank=i if hot else i - n_hot, source="hot" if hot else "cold"))
    directive = ("You are Acme Cloud's customer support agent. Answer billing, account and product questions "
                 "precisely and briefly. Never promise refunds outside the published policy.")
    return directive, hits[:n_hot], hits[n_hot:]
