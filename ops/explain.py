"""``ibex-context explain``: the whole CPU pipeline offline, to answer "why was my memory left out?".

Reads the request (an ``AssembleRequest`` as JSON) and what retrieval would have returned
(``{"directive": str|null, "hot": [hit], "cold": [hit]}``, each hit held to the one memory-hit
contract of ``pipeline.selection.hits``), runs the pipeline the worker runs (``pipeline.assemble``) with
no network, and prints the ``AssembleResponse`` as JSON or a table.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from ..pipeline.assemble import Engine, Policy, assemble
from ..pipeline.budget.catalog import Catalog
from ..pipeline.selection.hits import offline_result, shape_problem, to_hit
from ..pipeline.types import MemoryHit
from ..shared.config.settings import Settings
from ..shared.wire.errors import ContextOverflow, IbexError, InvalidRequest
from ..shared.wire.models import AssembleRequest, AssembleResponse, Source
from ..shared.wire.validation import first_error


class ExplainInputError(Exception):
    """A bad input file; the message says which file and what is wrong."""


def load_json(path: str, what: str) -> Any:
    """A JSON input file, or ``ExplainInputError`` naming the file and what is wrong (one line)."""
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ExplainInputError(f"{what} file {path!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:  # before ValueError: it is one
        raise ExplainInputError(f"{what} file {path!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ExplainInputError(f"{what} file {path!r} is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # json recurses per nesting level; a hostile file must not crash us
        raise ExplainInputError(f"{what} file {path!r} is nested too deeply to be a request") from exc


def load_request(path: str) -> AssembleRequest:
    doc = load_json(path, "request")
    if isinstance(doc, dict) and "deadline_ns" not in doc:
        doc["deadline_ns"] = time.time_ns() + 60_000_000_000  # offline: no deadline to honour
    try:
        return AssembleRequest.model_validate_json(json.dumps(doc))
    except ValidationError as exc:
        err = first_error(exc, root="<root>")
        raise ExplainInputError(f"request file {path!r}: {err.field}: {err.message}") from exc


def load_candidates(path: str) -> tuple[str | None, list[MemoryHit], list[MemoryHit]]:
    doc = load_json(path, "candidates")
    if not isinstance(doc, dict):
        raise ExplainInputError(f"candidates file {path!r}: expected an object with directive, hot, cold")
    unknown = set(doc) - {"directive", "hot", "cold"}
    if unknown:
        raise ExplainInputError(f"candidates file {path!r}: unknown key(s) {sorted(unknown)}")
    directive = doc.get("directive")
    if directive is not None and not isinstance(directive, str):
        raise ExplainInputError(f"candidates file {path!r}: directive must be a string or null")
    lists: dict[Source, list[MemoryHit]] = {"hot": [], "cold": []}
    for source in ("hot", "cold"):
        raw = doc.get(source, [])
        if not isinstance(raw, list):
            raise ExplainInputError(f"candidates file {path!r}: {source} must be a list")
        for i, hit in enumerate(raw):
            lists[source].append(_hit(path, source, i, hit))
    return directive, lists["hot"], lists["cold"]


def _hit(path: str, source: Source, i: int, hit: Any) -> MemoryHit:
    """One hit, held to the memory-hit contract; a bad memory_id alphabet is left to the scorer,
    which reports it as a ``malformed`` decision, and so are out-of-range or NaN scores
    (``invalid_score``): those are answers, not input errors."""
    problem = shape_problem(hit)
    if problem is not None:
        raise ExplainInputError(f"candidates file {path!r}: {source}[{i}]: {problem}")
    return to_hit(hit, source)


def explain(request: AssembleRequest, directive: str | None, hot: list[MemoryHit], cold: list[MemoryHit],
            *, nonce: str | None = None, settings: Settings | None = None,
            catalog: Catalog | None = None) -> AssembleResponse:
    settings = settings or Settings()
    catalog = catalog or Catalog.load(settings.catalog_path)
    retrieval = offline_result(directive=directive if request.options.include_directive else None,
                               hot=hot if request.options.include_hot else [],
                               cold=cold if request.options.include_cold else [],
                               hot_cap=settings.hot_limit, cold_cap=settings.cold_limit)
    engine = Engine(catalog, Policy.from_settings(settings, verify_format=True))
    return assemble(request, retrieval, engine, nonce=nonce)


def render_table(resp: AssembleResponse, out: TextIO) -> None:
    b = resp.budget
    w = out.write
    rule = b.count_rule or b.estimate_kind
    w(f"request {resp.request_id}   model {b.model} ({b.tokenizer_family}, {rule} counts)\n\n")
    w("Budget\n")
    rows = [("context window", b.context_window), ("- response reserve", b.response_reserve),
            ("- safety buffer", b.safety_buffer), ("- directive", b.directive_tokens),
            ("- recent messages", b.messages_tokens), ("- tool schemas", b.tool_schema_tokens),
            ("- formatter overhead", b.formatter_overhead_tokens), ("= usable for memories", b.usable)]
    for label, n in rows:
        w(f"  {label:<24}{n:>10}\n")
    if b.constrained:
        w("  CONSTRAINED: less than 256 tokens left for memories\n")
    p = resp.packer
    w(f"\nPacker: path={p.path} evaluated={p.evaluated} packed={len(resp.packed)} "
      f"excluded_for_budget={p.excluded_for_budget} tokens={p.total_tokens}/{p.token_budget} "
      f"budget_reached={p.budget_reached}\n\n")
    w(f"{'decision':<16}{'source':<7}{'tokens':>8}{'score':>8}  {'memory_id':<28} reason\n")
    order = {"packed": 0, "excluded_budget": 1}
    for d in sorted(resp.decisions, key=lambda d: (order.get(d.decision, 2), -(d.score or 0.0), d.memory_id)):
        tokens = "" if d.tokens is None else str(d.tokens)
        score = "" if d.score is None or math.isnan(d.score) else f"{d.score:.3f}"
        w(f"{d.decision:<16}{d.source:<7}{tokens:>8}{score:>8}  {d.memory_id[:28]:<28} {d.reason}\n")
        if d.components:
            w(f"{'':<39}{'  '.join(f'{k} {v:.3f}' for k, v in d.components.items())}\n")
        if d.retrieval:
            w(f"{'':<39}{'  '.join(f'{k} score {v:.3f}' for k, v in d.retrieval.items())}\n")
    if resp.format is not None:
        _chat_table(resp, w)
    if resp.summary is not None:
        w(f"\n{summary_line(resp)}\n")
    if resp.degraded:
        w(f"\nDEGRADED: {'; '.join(resp.degraded_reasons)}\n")
    w(f"\nsections: {', '.join(f'{s.name} ({s.tokens} tokens)' for s in resp.sections) or 'none'}   "
      f"nonce {resp.nonce}\n")


def _chat_table(resp: AssembleResponse, w: Any) -> None:
    """A chat request: the prompt the proxy sends, each history message left out to fit, and each
    kept message cleared (context editing) or whose thinking was counted by the provider's rule."""
    w(f"\nPrompt ({resp.format}): {len(resp.messages or [])} messages, {resp.prompt_tokens} tokens "
      f"({resp.prompt_tokens_kind}); history left out: {len(resp.history)}\n")
    for h in resp.history:
        w(f"  dropped message {h.index:>4} {h.role:<10}{h.tokens:>8} tokens  {h.reason}\n")
    for e in resp.edits:
        what = {"cleared": "saved", "thinking_free": "not charged", "thinking_counted": "charged"}[e.action]
        w(f"  {e.action:<16} {e.index:>4} {e.role:<10}{e.tokens:>8} tokens {what}  {e.reason}\n")


def summary_line(resp: AssembleResponse) -> str:
    """The compaction summary: what it covers, its tokens, whether it was sent, and why not."""
    s = resp.summary
    assert s is not None
    sent = "placed" if s.placed else f"NOT placed: {s.reason}"
    return (f"Summary ({s.source}): covers {s.covers} messages, {s.tokens} tokens, {sent}; leading messages "
            f"not sent: {resp.history_dropped_upto}")


def run(args: Any, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Exit 2 with one line for a bad file or option (the caller's to fix); 1 for a pipeline fault.
    ``out`` and ``err`` default to the ``sys.stdout`` and ``sys.stderr`` of the call, not of the import."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err

    def fail(message: str, code: int) -> int:
        err.write(f"ibex-context explain: {' '.join(message.split())}\n")
        return code

    try:
        request = load_request(args.request)
        directive, hot, cold = load_candidates(args.candidates)
    except ExplainInputError as exc:
        return fail(str(exc), 2)
    try:
        resp = explain(request, directive, hot, cold, nonce=args.nonce)
    except (InvalidRequest, ContextOverflow) as exc:  # unknown model, a conversation over the window
        return fail(f"request file {args.request!r}: {exc.code.value}: {exc.message}", 2)
    except IbexError as exc:
        return fail(f"{exc.code.value}: {exc.message}", 1)
    except ValueError as exc:  # the formatter refuses a bad --nonce; anything else is ours
        return fail(f"--nonce: {exc}", 2) if args.nonce is not None else fail(f"INTERNAL: {exc}", 1)
    if args.format == "json":
        out.write(resp.model_dump_json(indent=2) + "\n")
    else:
        render_table(resp, out)
    return 0
