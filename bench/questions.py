"""A large generated pool of questions, so a run can send a question never seen before every time.

A proxy's call carries the conversation's newest turn: the memory service has never embedded it,
so its MiniLM pass is paid on every assembly. A bench that repeats a handful of questions measures
the service's query cache instead. Each demo agent gets a grammar of four slots (an opener, what
the question is about, what is asked, a qualifier), 12 choices each: 20,736 distinct questions per
agent, 124,416 in all, on the agents' own topics so retrieval still finds their memories.
``FreshQuestions`` walks the pool in a scrambled order from a random start and never hands out a
question twice in one process (past the end it appends a counter, so a question stays new).
"""

from __future__ import annotations

import itertools
import secrets

OPENERS = ("Quick question:", "Before I reply,", "Can you check", "I need to know", "Please look up",
           "Help me understand", "Remind me", "The user wants to know", "For my notes,", "One more thing:",
           "Following up:", "Could you find out")
ASKS = ("what happened last time", "who handled it before", "whether it is still open", "what we promised",
        "what the usual fix is", "how long it usually takes", "what the policy says", "who to escalate to",
        "what changed since last month", "what they asked for before", "whether anything is overdue",
        "what we should say next")
QUALIFIERS = ("for this account?", "before Friday?", "on the enterprise plan?", "for the Berlin office?",
              "in the last quarter?", "and is it urgent?", "compared with last year?", "for the new team?",
              "in plain words?", "with the latest numbers?", "for the renewal?", "after the migration?")
TOPICS: dict[str, tuple[str, ...]] = {
    "support-bot": ("the October invoice", "the duplicate charge", "the backup dashboard", "the SSO login",
                    "the contact preferences", "the refund request", "the plan upgrade", "the slow exports",
                    "the password reset", "the billing address", "the API rate limit", "the support ticket"),
    "sales-assistant": ("the renewal call", "the discount offer", "the contract terms", "the pricing tier",
                        "the champion on the account", "the procurement process", "the pilot results",
                        "the competing quote", "the expansion seats", "the budget cycle", "the signed order form",
                        "the executive sponsor"),
    "devops-helper": ("the nightly deploy", "the staging database", "the on-call rota", "the failing pipeline",
                      "the TLS certificate", "the disk alert", "the rollback plan", "the Kubernetes upgrade",
                      "the paging policy", "the build cache", "the latency spike", "the secrets rotation"),
    "research-agent": ("competitor pricing", "the analyst's sources", "the market report", "the survey results",
                       "the churn study", "the pricing interviews", "the industry forecast", "the patent search",
                       "the benchmark numbers", "the customer panel", "the literature review", "the data licence"),
    "hr-helper": ("parental leave", "vacation carry-over", "the remote work policy", "the expense rules",
                  "the onboarding checklist", "the promotion cycle", "the sick leave policy", "the training budget",
                  "the relocation package", "the performance review", "the pension plan", "the notice period"),
}
_TOPIC_COUNTS = {len(t) for t in TOPICS.values()}
assert len(_TOPIC_COUNTS) == 1, "every agent needs as many topics, or its pool would repeat"
SLOTS = (len(OPENERS), _TOPIC_COUNTS.pop(), len(ASKS), len(QUALIFIERS))
PER_AGENT = SLOTS[0] * SLOTS[1] * SLOTS[2] * SLOTS[3]
_STRIDE = 7919  # prime, coprime with PER_AGENT: consecutive draws differ in every slot


def question(agent: str, k: int) -> str:
    """The ``k``-th question of ``agent``'s pool (``k`` below ``PER_AGENT``: all distinct)."""
    topics = TOPICS.get(agent, TOPICS["support-bot"])
    j = (k % PER_AGENT) * _STRIDE % PER_AGENT
    o, rest = j % SLOTS[0], j // SLOTS[0]
    t, rest = rest % SLOTS[1], rest // SLOTS[1]
    a, q = rest % SLOTS[2], rest // SLOTS[2]
    text = f"{OPENERS[o]} {ASKS[a]} about {topics[t]}, {QUALIFIERS[q]}"
    lap = k // PER_AGENT
    return text if lap == 0 else f"{text} (again, {lap})"


class FreshQuestions:
    """Hands out each agent's questions once, from a random start per agent (so two runs against
    one long-lived memory service do not share questions either)."""

    def __init__(self, start: int | None = None) -> None:
        self._start = start
        self._next: dict[str, itertools.count[int]] = {}

    def __call__(self, agent: str) -> str:
        counter = self._next.get(agent)
        if counter is None:
            start = secrets.randbelow(PER_AGENT) if self._start is None else self._start
            counter = self._next[agent] = itertools.count(start)
        return question(agent, next(counter))
