"""``python -m bench.escaping``: tokens the formatter's escaping costs, before and after the change.

Before: every untrusted string (history, tool schemas, memory bodies and attributes) was
HTML-escaped, quotes included (``_old_escape`` below, kept verbatim for this comparison). After:
memory bodies escape ``&``, ``<``, ``>``; attributes also quotes; history and tool schemas are only
neutralised (``worker.format``, docs/security.md "Degradation and security"). Both renderings are counted in
one run with the exact o200k counter on: every memory of ``memory/data/demo.jsonl`` in one
memories section, an OpenAI-style tools list, and a short conversation with apostrophes and
quotes. Measurement only: nothing here is used by the service.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.tables import table
from ibex_context.memory.service.seed import derived_memory_id
from ibex_context.pipeline import format as fmt
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.types import MemoryHit, ScoredMemory
from ibex_context.shared.wire.models import Message

DEMO = Path(__file__).resolve().parent.parent / "memory" / "data" / "demo.jsonl"
NONCE = "0123456789abcdef0123456789abcdef"

# The escaping every untrusted string got before (worker/format.py up to this change).
_OLD_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff\ufff9-\ufffb]"
)


def _old_neutralise(match: re.Match[str]) -> str:
    ch = match.group()
    if ch == "\r":
        return "\n"
    if "\ud800" <= ch <= "\udfff":
        return "\ufffd"
    return f"\\u{{{ord(ch):04X}}}"


def _old_escape(text: str) -> str:
    text = (text.replace("\r\n", "\n").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))
    return text if _OLD_UNSAFE.search(text) is None else _OLD_UNSAFE.sub(_old_neutralise, text)


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "send_invoice",
        "description": "Email a copy of one of the customer's invoices to the address on file.",
        "parameters": {"type": "object", "properties": {
            "month": {"type": "string", "description": "Billing month, e.g. \"2026-10\"."},
            "email": {"type": "string", "description": "Override the account's billing email."}},
            "required": ["month"]}}},
    {"type": "function", "function": {
        "name": "lookup_account",
        "description": "Look up the customer's plan, region and open tickets. Don't call it twice per turn.",
        "parameters": {"type": "object", "properties": {
            "account_id": {"type": "string"}}, "required": ["account_id"]}}},
    {"type": "function", "function": {
        "name": "escalate",
        "description": "Open an escalation to the on-call engineer for security or outage issues.",
        "parameters": {"type": "object", "properties": {
            "severity": {"type": "string", "enum": ["low", "high", "critical"]},
            "summary": {"type": "string"}}, "required": ["severity", "summary"]}}},
]

HISTORY = [
    Message(role="user", content="Hi, I can't find last month's invoice. It's the one for \"Acme Backup\"."),
    Message(role="assistant", content="Sure, I'll resend it. Which address should I use, the one on file?"),
    Message(role="user", content="Yes, the one on file - it's billing@example.com. Don't CC my manager."),
    Message(role="assistant", content="Done: I've sent October's invoice to billing@example.com."),
    Message(role="user", content="Thanks! And what's the \"Pro\" plan's price in EUR?"),
]


def demo_memories(path: Path) -> list[ScoredMemory]:
    """Every memory record in the demo file, as the formatter would receive it."""
    out: list[ScoredMemory] = []
    for i, line in enumerate(path.read_text("utf-8").splitlines()):
        rec = json.loads(line)
        if rec.get("kind") != "memory":
            continue
        mid = rec.get("memory_id") or derived_memory_id(rec["org_id"], rec["agent_id"], rec["content"])
        hit = MemoryHit(mid, rec["content"], rec["category"], 0.5, float(rec["confidence"]), i, "hot")
        out.append(ScoredMemory(hit, 0, 0.5))
    return out


def _old_sections(memories: Sequence[ScoredMemory]) -> dict[str, str]:
    head, tail = fmt.memory_frame(NONCE)
    lines = "".join(f'<memory id="{_old_escape(m.hit.memory_id)}" category="{_old_escape(m.hit.category)}">'
                    f"{_old_escape(m.hit.content)}</memory>\n" for m in memories)
    tools = [_old_escape(json.dumps(s, sort_keys=True, separators=(",", ":"), ensure_ascii=False)) for s in TOOLS]
    return {
        "history": fmt.HISTORY_HEADER + "\n".join(f"[{m.role}] {_old_escape(m.content)}" for m in HISTORY),
        "tools": fmt.TOOLS_HEADER + "\n".join(tools),
        "memories": head + lines + tail,
    }


def _new_sections(memories: Sequence[ScoredMemory]) -> dict[str, str]:
    return {"history": fmt.history_section(HISTORY), "tools": fmt.tools_section(TOOLS),
            "memories": fmt.memory_section(memories, NONCE)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.escaping", description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEMO, help="memories JSONL (memory.service.seed format)")
    ap.add_argument("--family", default="o200k", help="tokenizer family from the catalog")
    args = ap.parse_args(argv)
    counter = Catalog.load().counter(args.family)
    memories = demo_memories(args.data)
    before, after = _old_sections(memories), _new_sections(memories)
    rows: list[list[Any]] = []
    totals = [0, 0]
    for name in ("history", "tools", "memories"):
        b, a = counter.count(before[name]), counter.count(after[name])
        totals[0] += b
        totals[1] += a
        rows.append([name, b, a, f"{b - a} ({(b - a) / b:.1%})"])
    b, a = totals
    rows.append(["total", b, a, f"{b - a} ({(b - a) / b:.1%})"])
    print(f"{len(memories)} demo memories, {len(TOOLS)} tools, {len(HISTORY)} messages; "
          f"{counter.family} ({counter.kind}) tokens\n")
    print("\n".join(table(["section", "tokens before", "tokens after", "saving"], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
