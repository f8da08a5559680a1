"""Compaction summaries made by the LiteLLM hook, off the call path (README "Compaction summaries").

* pre-call: the conversation's ``summary_key`` (LiteLLM's session or trace id when the call has
  one, else a digest of the org, the agent and the conversation's first non-system message), so
  the worker loads the stored summary; after the assembly, ``plan`` decides whether a new one is
  due: the kept history is above ``high_water`` of what the history may use, or messages were
  dropped that no summary covers. The new ``covers`` is chosen on a unit boundary
  (``pipeline.conversation.summary.cover_boundaries``, from one split of the conversation) so the kept history
  falls to ``low_water``: compaction ahead of need, so the next calls do not trim.
* success: ``launch`` starts the summary in a background task with its own timeout, at most one
  per ``summary_key``: the previous summary (the hook's own copy of the last one it made for the
  key, when its ``covers`` is the one the worker placed; else the conversation is summarized from
  its start) and the messages after it up to the new ``covers``, sent to the configured model
  through LiteLLM's router with ``prompt``; the answer (cut to ``max_chars``) goes to
  ``AsyncClient.report_summary``. A failure or a timeout is logged and counted (``stats``), never
  seen by a call.

LiteLLM is imported only inside ``complete_with_litellm``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import re
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ....pipeline.conversation.summary import cover_boundaries, non_system
from ....pipeline.types import Turns
from ....shared.wire.models import SUMMARY_KEY_CHARS, AssembleResponse
from ...client import AsyncClient
from .config import Summaries

log = logging.getLogger(__name__)

PENDING_MAX = 1_000  # calls whose success may start a summary; the oldest are forgotten
COPIES_MAX = 10_000  # the last summary the hook made per key (its text, to fold into the next)
TRANSCRIPT_MAX_CHARS = 400_000  # what one summary call sends at most (the oldest part kept whole)
ROUNDOFF = 2.0 ** -53  # a float addition's relative error at most: bounds how far two orders of one sum differ
_KEY = re.compile(SUMMARY_KEY_CHARS)
Complete = Callable[[str, list[dict[str, Any]], int, float], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Plan:
    """A summary due after a call: what it folds (``prev_text`` over ``prev_covers`` messages, then
    the messages up to ``covers``)."""

    org_id: str
    agent_id: str
    key: str
    covers: int
    prev_covers: int
    prev_text: str | None
    messages: list[Any]
    format: str


def conversation_key(meta: Mapping[str, Any], data: Mapping[str, Any], org_id: str, agent_id: str,
                     messages: Sequence[Any]) -> str:
    """LiteLLM's session id (``litellm_session_id``) or trace id when the call has one, else a
    stable digest of the org, the agent and the first non-system message."""
    for name in ("litellm_session_id", "session_id", "litellm_trace_id", "trace_id"):
        value = data.get(name) if name in data else meta.get(name)
        if isinstance(value, str) and value:
            return f"s:{value}" if _KEY.fullmatch(f"s:{value}") else f"s:{_digest(value)}"
    first = next((m for m in messages if isinstance(m, Mapping) and m.get("role") not in ("system", "developer")),
                 None)
    return f"h:{_digest(json.dumps([org_id, agent_id, first], sort_keys=True, default=str))}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _cost_shares(messages: Sequence[Any], kept: Sequence[int], tokens: int) -> dict[int, float]:
    """``tokens`` spread over the kept messages by their JSON length (the reply counts the history
    as a whole; its share per message is what the next covers is chosen with)."""
    sizes = {i: len(json.dumps(messages[i], default=str)) for i in kept}
    total = sum(sizes.values()) or 1
    return {i: tokens * n / total for i, n in sizes.items()}


def choose_covers(fmt: str, messages: list[Any], assembly: AssembleResponse, *, low_water: float,
                  summary_tokens: int) -> int | None:
    """The new ``covers``: the smallest one on a unit boundary (and at least what was dropped) that
    brings the kept history with a summary of ``summary_tokens`` to ``low_water`` of what the
    history may use; else the largest one allowed. None when none covers more than the placed summary.

    Linear in the conversation: one split into units gives every boundary (``cover_boundaries``),
    and running sums give what each one leaves (``_first_within``)."""
    turns = Turns(format=fmt, target=fmt, messages=messages, tools=[])  # type: ignore[arg-type]
    budget = assembly.budget
    available = budget.messages_tokens + max(0, budget.unclamped)
    placed = assembly.summary.covers if assembly.summary is not None and assembly.summary.placed else 0
    at_least = max(placed + 1, assembly.history_dropped_upto)
    dropped = {d.index for d in assembly.history}
    kept = [i for i in range(len(messages)) if i not in dropped]
    shares = _cost_shares(messages, kept, budget.messages_tokens)
    ns = non_system(turns)
    fits = [c for c in cover_boundaries(turns) if c >= at_least] if at_least <= len(ns) else []
    if not fits:
        return None
    first = _first_within(fits, ns, shares, summary_tokens, low_water * available, len(messages))
    return fits[-1] if first is None else first


def _running_sums(ns: Sequence[int], shares: Mapping[int, float], n: int) -> tuple[list[float], list[float], list[int]]:
    """Per message index ``i``: the shares of the kept messages from ``i`` on, of the kept system
    messages before ``i``, and how many kept non-system messages come before ``i``."""
    counted = [False] * n
    for i in ns:
        counted[i] = True
    after = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        after[i] = after[i + 1] + shares.get(i, 0.0)
    system, held = [0.0] * (n + 1), [0] * (n + 1)
    for i in range(n):
        kept = i in shares
        system[i + 1] = system[i] + (shares[i] if kept and not counted[i] else 0.0)
        held[i + 1] = held[i] + (kept and counted[i])
    return after, system, held


def _first_within(fits: Sequence[int], ns: Sequence[int], shares: Mapping[int, float], summary_tokens: int,
                  limit: float, n: int) -> int | None:
    """The first of ``fits`` whose uncovered kept messages' shares plus ``summary_tokens`` are at
    most ``limit``, or None.

    What a candidate leaves comes from running sums, added in another order than the kept
    messages' own; the two differ by at most ``margin`` (a bound on the rounding of either sum).
    Only a candidate that close to ``limit`` has its shares summed again in their own order, once
    per set of messages left, so a near tie is decided exactly as that sum decides it."""
    after, system, held = _running_sums(ns, shares, n)
    total = after[0]
    # no rounding to allow for when every share is 0, or the limit is not finite (or NaN: never within)
    exact = (total == 0.0 and float(summary_tokens) == summary_tokens) or not abs(limit) < float("inf")
    # either sum is off by under (additions) * ROUNDOFF * total, the last additions and the
    # comparison by a few ROUNDOFF more: twice that, so a candidate outside it is decided either way
    margin = 0.0 if exact else 4 * (len(shares) + 4) * ROUNDOFF * (total + abs(summary_tokens) + abs(limit))
    refused: set[int] = set()  # sets of messages left (by the kept non-system messages covered) over the limit
    for c in fits:
        last = ns[c - 1]
        near = system[last] + after[last + 1] + summary_tokens
        if near <= limit - margin:
            return c
        if not near <= limit + margin or held[last + 1] in refused:
            continue
        covered = set(ns[:c])
        if sum(v for i, v in shares.items() if i not in covered) + summary_tokens <= limit:
            return c
        refused.add(held[last + 1])
    return None


def due(assembly: AssembleResponse, high_water: float) -> bool:
    """A summary is due: the kept history is over ``high_water`` of what it may use, or messages
    were dropped that no placed summary covers."""
    budget = assembly.budget
    available = budget.messages_tokens + max(0, budget.unclamped)
    placed = assembly.summary.covers if assembly.summary is not None and assembly.summary.placed else 0
    return assembly.history_dropped_upto > placed or budget.messages_tokens > high_water * available


def _text_of(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    parts = [str(content)] if content else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        parts.append(f"calls {fn.get('name')}({fn.get('arguments')})")
    return " ".join(parts)


def transcript(plan: Plan) -> str:
    """The summary call's user message: the previous summary, then the messages it is to take in."""
    turns = Turns(format=plan.format, target=plan.format, messages=plan.messages, tools=[])  # type: ignore[arg-type]
    ns = non_system(turns)
    lines = [f"[{m.get('role')}] {_text_of(m)}" for m in (plan.messages[i] for i in ns[plan.prev_covers:plan.covers])
             if isinstance(m, Mapping)]
    body = "\n".join(lines)
    if len(body) > TRANSCRIPT_MAX_CHARS:
        body = body[:TRANSCRIPT_MAX_CHARS]
    head = f"Previous summary:\n{plan.prev_text}\n\n" if plan.prev_text else ""
    return f"{head}Messages:\n{body}"


async def complete_with_litellm(model: str, messages: list[dict[str, Any]], max_tokens: int, timeout_s: float) -> str:
    """The model's answer through the proxy's router (its deployments, keys and retries), or
    ``litellm.acompletion`` outside a proxy."""
    import litellm

    router = None
    try:
        from litellm.proxy import proxy_server

        router = proxy_server.llm_router
    except Exception:  # no proxy around this hook
        router = None
    call = router.acompletion if router is not None else litellm.acompletion
    resp = await call(model=model, messages=messages, max_tokens=max_tokens, timeout=timeout_s)
    text = resp.choices[0].message.content
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the summary model answered no text")
    return text.strip()


class Summarizer:
    """The hook's summaries (module docstring), configured by the hook config's ``summaries``."""

    def __init__(self, config: Summaries, *, complete: Complete = complete_with_litellm) -> None:
        self.config = config
        self.complete = complete
        self.pending: OrderedDict[str, tuple[Plan, AsyncClient, asyncio.AbstractEventLoop]] = OrderedDict()
        self.copies: OrderedDict[str, tuple[int, str]] = OrderedDict()  # key -> (covers, text) it made last
        self.inflight: dict[str, concurrent.futures.Future[None]] = {}
        self.stats: Counter[str] = Counter()

    def plan(self, org_id: str, agent_id: str, key: str, fmt: str, messages: list[Any],
             assembly: AssembleResponse, client: AsyncClient) -> tuple[str, int] | None:
        """(ticket, covers) when a summary is due after this call (kept until its success), else None."""
        if assembly.degraded or assembly.format is None or not due(assembly, self.config.high_water):
            return None
        covers = choose_covers(fmt, messages, assembly, low_water=self.config.low_water,
                               summary_tokens=self.config.max_chars // 4)
        if covers is None:
            self.stats["summary_no_boundary"] += 1
            return None
        placed = assembly.summary.covers if assembly.summary is not None and assembly.summary.placed else 0
        copy = self.copies.get(key)
        prev = (placed, copy[1]) if copy is not None and copy[0] == placed and placed else (0, None)
        ticket = secrets.token_urlsafe(12)
        self.pending[ticket] = (Plan(org_id, agent_id, key, covers, prev[0], prev[1], messages, fmt), client,
                                asyncio.get_running_loop())
        while len(self.pending) > PENDING_MAX:
            self.pending.popitem(last=False)
        return ticket, covers

    def forget(self, ticket: object) -> None:
        if isinstance(ticket, str):
            self.pending.pop(ticket, None)

    def launch(self, ticket: object) -> bool:
        """Start the summary planned under ``ticket`` (the call succeeded); never raises."""
        got = self.pending.pop(ticket, None) if isinstance(ticket, str) else None
        if got is None:
            return False
        plan, client, loop = got
        if plan.key in self.inflight:
            self.stats["summary_skipped_inflight"] += 1
            return False
        fut = asyncio.run_coroutine_threadsafe(self._make(plan, client), loop)  # the client's own loop
        self.inflight[plan.key] = fut
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self.inflight.pop, plan.key, None))
        self.stats["summary_started"] += 1
        return True

    async def _make(self, plan: Plan, client: AsyncClient) -> None:
        cfg = self.config
        prompt = [{"role": "system", "content": cfg.prompt.replace("{max_chars}", str(cfg.max_chars))},
                  {"role": "user", "content": transcript(plan)}]
        try:
            async with asyncio.timeout(cfg.timeout_s):
                text = await self.complete(cfg.model, prompt, max(64, cfg.max_chars // 3), cfg.timeout_s)
        except Exception as exc:  # the model failed or hung: the calls go on as before
            self.stats["summary_failed"] += 1
            log.warning("ibex-context: summary of %s failed: %s", plan.key, f"{type(exc).__name__}: {exc}"[:300])
            return
        text = text[:cfg.max_chars]
        if client.report_summary(org_id=plan.org_id, agent_id=plan.agent_id, summary_key=plan.key, text=text,
                                 covers=plan.covers, as_memory=cfg.as_memory, ttl_s=cfg.ttl_s, made_at=time.time()):
            self.copies[plan.key] = (plan.covers, text)
            self.copies.move_to_end(plan.key)
            while len(self.copies) > COPIES_MAX:
                self.copies.popitem(last=False)
            self.stats["summary_sent"] += 1
        else:
            self.stats["summary_not_sent"] += 1
