"""Long tool-heavy agent sessions, generated from a fixed seed, for the context-editing benches.

A coding agent at work: the user states a few labelled facts early ("[F1] the staging database
listens on port 5433."), then asks for work turn after turn; each turn the agent reads files and
runs commands (one to three tool calls whose outputs are 2 to 50 KB, log-uniform), then answers in
a few sentences. The last user message asks about the early facts by label. Each session is in
OpenAI's chat shape; ``to_anthropic`` gives the same in Anthropic's.

``calls`` lists every model call of the session as the length of the prefix the agent sends at it
(after each user message and after each tool result), so a bench can replay the session call by
call, as a provider's prompt cache sees it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

Msg = dict[str, Any]

TOOLS = ("read_file", "run_command")
TOOL_DEFS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "description": "Return a file of the repository",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_command", "description": "Run a shell command in the sandbox",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
]
MIN_OUTPUT, MAX_OUTPUT = 2 * 1024, 50 * 1024
_MODULES = ("billing", "invoices", "auth", "scheduler", "storage", "search", "export", "webhooks", "reports")
_WORDS = ("value", "config", "retry", "timeout", "customer", "order", "total", "status", "pending", "token",
          "cache", "request", "handler", "queue", "worker", "record", "batch", "limit", "offset", "schema")
_FACTS = (
    "the staging database listens on port {n}", "my employee badge number is {n}",
    "the release freeze starts on day {d} of the sprint", "the on-call pager code is {n}",
    "the feature flag for the new checkout is flag-{n}", "our tenant id in production is t-{n}",
    "the load balancer drains connections after {d} seconds", "the vendor contract number is VC-{n}",
)


@dataclass(frozen=True, slots=True)
class Session:
    """One generated session: its messages (OpenAI shape, ending on the late question), the labelled
    facts as stated (each verbatim in an early user message) and its model calls (prefix lengths)."""

    messages: list[Msg]
    facts: list[str]
    calls: list[int]


def output_size(rng: random.Random) -> int:
    """A tool output's size in bytes: log-uniform over 2 to 50 KB."""
    return int(MIN_OUTPUT * math.exp(rng.random() * math.log(MAX_OUTPUT / MIN_OUTPUT)))


def _file(rng: random.Random, path: str, size: int) -> str:
    lines, n, total = [], 1, 0
    while total < size:
        w = rng.sample(_WORDS, 3)
        line = f"{n:5d}  def {w[0]}_{w[1]}(self, {w[2]}: int = {rng.randint(0, 999)}) -> None:  # {path}"
        lines.append(line)
        total += len(line) + 1
        n += 1
    return "\n".join(lines)[:size]


def _log(rng: random.Random, command: str, size: int) -> str:
    lines, total = [f"$ {command}"], len(command) + 2
    while total < size:
        w = rng.sample(_WORDS, 2)
        line = (f"tests/test_{rng.choice(_MODULES)}.py::test_{w[0]}_{w[1]} "
                f"{'FAILED' if rng.random() < 0.1 else 'PASSED'} [{rng.randint(1, 999)} ms]")
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def _fact(rng: random.Random, label: int, template: str) -> str:
    return f"[F{label}] " + template.format(n=rng.randint(1000, 99999), d=rng.randint(2, 90)) + "."


def _turn(rng: random.Random, t: int, calls: list[int], out: list[Msg], counter: list[int],
          fact: str | None) -> None:
    module = rng.choice(_MODULES)
    ask = (f"Step {t}: the {module} tests fail after my change to {rng.choice(_WORDS)} handling. "
           f"Can you look at {module}/{rng.choice(_WORDS)}.py and fix it?")
    out.append({"role": "user", "content": ask + (f" Keep in mind: {fact}" if fact else "")})
    calls.append(len(out))
    for _ in range(rng.randint(1, 3)):
        cid = f"call_{counter[0]}"
        counter[0] += 1
        name = rng.choice(TOOLS)
        if name == "read_file":
            arg = {"path": f"{module}/{rng.choice(_WORDS)}.py"}
            content = _file(rng, arg["path"], output_size(rng))
        else:
            arg = {"command": f"pytest tests/test_{module}.py -q"}
            content = _log(rng, arg["command"], output_size(rng))
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arg)}}]})
        out.append({"role": "tool", "tool_call_id": cid, "content": content})
        calls.append(len(out))
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60)))
    out.append({"role": "assistant", "content": f"Fixed step {t} in {module}: {words}."})


def session(rng: random.Random, turns: int, n_facts: int = 3) -> Session:
    """A session of ``turns`` work turns; the first ``n_facts`` user messages each state a labelled fact."""
    templates = rng.sample(_FACTS, n_facts)
    facts = [_fact(rng, k + 1, tpl) for k, tpl in enumerate(templates)]
    out: list[Msg] = [{"role": "system", "content": "You are a coding agent working in the user's repository."}]
    calls: list[int] = []
    counter = [0]
    for t in range(turns):  # a fact stated early, in the user's own words, in each of the first turns
        _turn(rng, t, calls, out, counter, facts[t] if t < n_facts else None)
    labels = ", ".join(f"[F{k + 1}]" for k in range(n_facts))
    out.append({"role": "user", "content": f"Before we finish: what did I tell you in {labels}?"})
    calls.append(len(out))
    return Session(out, facts, calls)


def sessions(seed: int, count: int, turns: int) -> list[Session]:
    """``count`` sessions of ``turns`` work turns each, the same for the same seed."""
    rng = random.Random(seed)
    return [session(rng, turns) for _ in range(count)]


def to_anthropic(msgs: list[Msg]) -> tuple[list[dict[str, Any]], list[Msg]]:
    """The same session in Anthropic's shape: (system blocks, messages); tool_use blocks in the
    assistant turn, tool_result blocks in one user turn per call."""
    system = [{"type": "text", "text": m["content"]} for m in msgs if m["role"] == "system"]
    out: list[Msg] = []
    for m in msgs:
        if m["role"] == "system":
            continue
        if m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return system, out


def words_kept(messages: list[Msg]) -> int:
    """User and assistant messages with words of their own (not tool calls or tool results)."""
    n = 0
    for m in messages:
        content = m.get("content")
        if m.get("role") not in ("user", "assistant"):
            continue
        if isinstance(content, str) and content:
            n += 1
        elif isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "text" for b in content):
            n += 1
    return n


def facts_kept(messages: list[Msg], facts: list[str]) -> int:
    """The labelled facts whose statement is still in a sent user message."""
    texts = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    return sum(1 for f in facts if any(f in t for t in texts))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(b.get("text", "") for b in content or () if isinstance(b, dict) and b.get("type") == "text")
