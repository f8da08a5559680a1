"""The client's degraded response: history-only (or directive + history) context built locally.

``assemble_or_degrade`` never raises for service faults (README "The client library"): it answers
with what the pure pipeline (``pipeline.assemble``, the one the worker runs) makes of no
memories, with the reason recorded. Only the pure pipeline is imported, so a proxy that imports
the client never loads aiohttp, redis or the worker (tests/meta/test_client_imports.py).

A fallback is due at the call's deadline, also while ``start()``'s thread is still loading the BPE
vocabularies (0.3-3 s after a process starts): until then ``Fallback.catalog`` answers with a
catalog that bounds every count by the text's UTF-8 bytes (``ByteBoundCatalog``), which needs no
vocabulary and never undercounts, so the conversation still fits its window (trimmed harder); a
conversation over the window by that bound waits for the exact count rather than be refused.

What the first fallback needs beside the vocabularies is made ready on that thread before them (the
byte-bound catalog, and one degraded build on it: the pipeline's first run compiles and caches), and
the fallback stops waiting for the vocabularies ``BUILD_RESERVE_S`` before the deadline, so the
first call's build fits inside its deadline rather than after it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

# The pipeline a degraded response runs, its chat-native part included (module-level imports
# all through, so its ~0.2-0.5 s of schema building happens here, not in the first fallback).
from ..pipeline.assemble import Engine, Policy, assemble
from ..pipeline.budget.catalog import Catalog
from ..pipeline.counting.tokens import CachedCounter, EstimateKind
from ..pipeline.selection.hits import failed_result
from ..shared.config.settings import PipelineSettings
from ..shared.wire.codec import validate
from ..shared.wire.errors import ContextOverflow, IbexError, Internal
from ..shared.wire.models import AssembleRequest, AssembleResponse, BranchOutcome, ErrorReply
from .requests import to_exc

log = logging.getLogger(__name__)

DIRECTIVE_HEADING = "## Directive\n"  # how pipeline.format.directive_section opens the directive's section
# The client's copies of directives (``DirectiveCopies``): bounded in entries, characters and age.
COPY_ENTRIES = 10_000
COPY_CHARS = 16_000_000
COPY_MAX_AGE_S = 86_400.0

# Time kept before a call's deadline for building its fallback: a short conversation's degraded
# build (~0.5-1 ms) and a turn of the GIL with the loading thread end by the deadline, not after
# it (the first call right after start: 49.7 ms median, 50.8 ms at most, at a 50 ms timeout).
BUILD_RESERVE_S = 0.003
# How long the loading thread waits after the first-call state is ready before it builds the
# vocabularies: bpe-openai's native build holds the GIL (~40 ms for o200k, ~20 ms for cl100k), so
# started at once it would land inside the calls right after start and push them past their
# deadlines. Later calls see at most one such hold (tests/stack/test_client_library.py bounds it).
VOCABULARY_DELAY_S = 0.25


def load_fallback(settings: PipelineSettings) -> Catalog | Exception:
    """Load the catalog and vocabularies ``degraded_response`` counts with (on a thread, from
    ``AsyncClient.start()``).

    A failure is returned, not raised, so it reaches the first fallback instead of an
    unretrieved-exception warning.
    """
    try:
        catalog = Catalog.load(settings.catalog_path, cache_entries=settings.token_cache_entries,
                               slow_vocabularies=False)
        catalog.warm_up()
        return catalog
    except Exception as exc:
        log.warning("the client's fallback could not load: %s", exc)
        return exc


def load_fallback_in_background(loop: asyncio.AbstractEventLoop, settings: PipelineSettings,
                                first: Callable[[], None] | None = None) -> asyncio.Future[Catalog | Exception]:
    """``load_fallback`` on a daemon thread (after ``first``, which must not raise), its result
    delivered to ``loop`` as a future.

    Not the loop's default executor: ``asyncio.run`` waits for that executor's threads when it
    ends, so a short-lived caller (a CLI call to a stopped broker) would wait ~1 s for a fallback
    it never uses; and a daemon thread does not hold up the interpreter's exit either.
    """
    future: asyncio.Future[Catalog | Exception] = loop.create_future()

    def deliver(result: Catalog | Exception) -> None:
        if not future.done():
            future.set_result(result)

    def work() -> None:
        if first is not None:
            first()
        time.sleep(VOCABULARY_DELAY_S)
        result = load_fallback(settings)
        try:
            loop.call_soon_threadsafe(deliver, result)
        except RuntimeError:  # the loop closed first: nobody is waiting
            pass

    threading.Thread(target=work, name="ibex-fallback-load", daemon=True).start()
    return future


class ByteBound:
    """A token count bound that needs no vocabulary: the text's UTF-8 bytes (or its NFC form's,
    when longer) times the family's estimate factor. No byte-level BPE (o200k, cl100k, Llama 3,
    Qwen) makes more tokens than the bytes it encodes, so this bounds each of them, and the
    factor keeps an estimate family's margin over them."""

    kind: EstimateKind = "estimate"

    def __init__(self, family: str, factor: float) -> None:
        self.family = family
        self.factor = max(1.0, factor)

    def count(self, text: str) -> int:
        n = len(text.encode("utf-8", "surrogatepass"))
        if not text.isascii():
            n = max(n, len(unicodedata.normalize("NFC", text).encode("utf-8", "surrogatepass")))
        return math.ceil(n * self.factor)


class ByteBoundCatalog(Catalog):
    """The catalog's models and windows with every family estimated by ``ByteBound``: what a
    fallback counts with before the vocabularies have loaded."""

    def __init__(self, data: dict[str, Any], *, cache_entries: int = 0, slow_vocabularies: bool = False) -> None:
        fams = data.get("families")
        if isinstance(fams, dict):
            data = {**data, "families": {name: {**f, "estimate_kind": "estimate", "encoding": None}
                                         for name, f in fams.items() if isinstance(f, dict)}}
        super().__init__(data, cache_entries=0, slow_vocabularies=False)
        self._bounds: dict[str, CachedCounter] = {}

    def counter(self, family: str) -> CachedCounter:
        c = self._bounds.get(family)
        if c is None:
            c = self._bounds[family] = CachedCounter(ByteBound(family, self.families[family].estimate_factor), 0)
        return c

    def warm_up(self) -> None:
        pass


BYTE_BOUND_NOTE = ("counted by UTF-8 bytes: the fallback's vocabularies were still loading "
                   "(AsyncClient.prepare_fallback waits for them)")


class Fallback:
    """What degraded responses are built with: the catalog ``start()`` loads on a thread, and until
    it is there one bounding counts by bytes (a call's fallback never waits past its deadline)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: PipelineSettings) -> None:
        self.settings = settings
        self._bytes: Catalog | None = None
        self.loaded = load_fallback_in_background(loop, settings, first=self._prepare_bytes)

    def _prepare_bytes(self) -> None:
        """The byte-bound catalog, with one degraded build run on it (on the loading thread, before
        the vocabularies): the first call finds both ready. A failure is left to that call to meet."""
        try:
            catalog = ByteBoundCatalog.load(self.settings.catalog_path)
            warm = AssembleRequest(request_id="warm-up", org_id="warm-up", agent_id="warm-up", query="",
                                   model=next(iter(catalog.models)), format="openai", deadline_ns=1,
                                   messages=[{"role": "user", "content": "warm up"}])
            degraded_response(warm, Internal("warm-up"), "warm up", catalog=catalog, settings=self.settings)
        except Exception as exc:  # the call meets it again, as a typed error
            log.debug("the byte-bound fallback did not warm up: %s", exc)
            return
        self._bytes = self._bytes or catalog

    async def ready(self) -> Catalog:
        """The loaded catalog, waited for; ``Internal`` when it cannot load."""
        loaded = await asyncio.shield(self.loaded)  # a cancelled caller must not cancel the load
        if isinstance(loaded, Exception):
            raise Internal(f"the fallback cannot load the model catalog: {loaded}") from loaded
        return loaded

    async def catalog(self, end: float) -> tuple[Catalog, str | None]:
        """(the catalog to build a fallback with by ``end`` (``time.monotonic()``), a note for the
        degraded reasons when it is the byte bound)."""
        remaining = end - BUILD_RESERVE_S - time.monotonic()
        if not self.loaded.done() and remaining > 0:
            await asyncio.wait({self.loaded}, timeout=remaining)  # never cancels the load
        if self.loaded.done():
            return await self.ready(), None
        if self._bytes is None:  # ~1 ms: the catalog's JSON, no vocabulary
            try:
                self._bytes = ByteBoundCatalog.load(self.settings.catalog_path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise Internal(f"the fallback cannot load the model catalog: {exc}") from exc
        return self._bytes, BYTE_BOUND_NOTE

    async def respond(self, req: AssembleRequest, exc: IbexError, fallback_directive: str | None,
                      end: float, copies: DirectiveCopies | None = None) -> AssembleResponse:
        """The degraded response, by ``end`` unless the byte bound finds the conversation over the
        window: that is no proof it is, so the exact count decides (after the vocabularies load).
        The request is checked as the worker would have checked it first (an outage skipped that).
        Without a ``fallback_directive``, the directive is the copy in ``copies`` when one is kept."""
        checked = validate(req.model_dump(mode="python"), AssembleRequest)  # e.g. NaN inside tool_schemas
        if isinstance(checked, ErrorReply):
            raise to_exc(checked, req.request_id)
        notes: list[str] = []
        copy = copies.get(req.org_id, req.agent_id) if copies is not None and fallback_directive is None else None
        if copy is not None and req.options.include_directive:
            fallback_directive = copy[0] or None
            notes.append(f"directive: the client's copy from an assembly {copy[1]:.0f} s ago" if copy[0] else
                         "directive: none (the agent had none at its last assembly)")
        catalog, note = await self.catalog(end)
        try:
            return degraded_response(req, exc, fallback_directive, catalog=catalog, settings=self.settings,
                                     notes=[*notes, note] if note else notes)
        except ContextOverflow:
            if note is None:
                raise
        return degraded_response(req, exc, fallback_directive, catalog=await self.ready(), settings=self.settings,
                                 notes=notes)


def fetched_directive(assembly: AssembleResponse) -> str | None:
    """The directive the service fetched for this assembly ("" when the agent has none), or None
    when it did not (the branch failed, timed out or was switched off, or the assembly is the
    client's fallback)."""
    branch = assembly.branches.get("directive")
    if branch is None or branch.status != "success":
        return None
    if branch.count == 0:
        return ""
    text = next((s.text for s in assembly.sections if s.name == "directive"), "")
    return text.removeprefix(DIRECTIVE_HEADING) if text.startswith(DIRECTIVE_HEADING) else None


class DirectiveCopies:
    """The last directive the service assembled each (org, agent) with ("" for an agent that has
    none), least recently kept evicted first, not used past ``COPY_MAX_AGE_S``: what a degraded
    response falls back on when its caller passes no ``fallback_directive``. In this process's
    memory only; the service's own answer replaces a copy on every assembly that fetched it."""

    def __init__(self, *, entries: int = COPY_ENTRIES, chars: int = COPY_CHARS,
                 max_age_s: float = COPY_MAX_AGE_S) -> None:
        self.entries, self.max_chars, self.max_age_s = entries, chars, max_age_s
        self._copies: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.chars = 0

    def keep(self, req: AssembleRequest, assembly: AssembleResponse) -> None:
        """Keep the directive ``assembly`` was made with, if the service fetched one for it."""
        text = fetched_directive(assembly)
        if text is None:
            return
        key = (req.org_id, req.agent_id)
        old = self._copies.pop(key, None)
        if old is not None:
            self.chars -= len(old[0])
        if len(text) > self.max_chars or self.entries == 0:
            return
        self._copies[key] = (text, time.monotonic())
        self.chars += len(text)
        while len(self._copies) > self.entries or self.chars > self.max_chars:
            _, (gone, _) = self._copies.popitem(last=False)
            self.chars -= len(gone)

    def get(self, org_id: str, agent_id: str) -> tuple[str, float] | None:
        """(the copy, its age in seconds) when one younger than ``max_age_s`` is kept."""
        got = self._copies.get((org_id, agent_id))
        if got is None:
            return None
        age = time.monotonic() - got[1]
        return (got[0], age) if age <= self.max_age_s else None

    def __len__(self) -> int:
        return len(self._copies)


def degraded_response(req: AssembleRequest, exc: IbexError, fallback_directive: str | None = None,
                      *, catalog: Catalog | None = None, settings: PipelineSettings | None = None,
                      notes: Sequence[str] = ()) -> AssembleResponse:
    """History-only (or directive + history) context built locally by the pure pipeline; every
    branch is recorded as failed with ``exc``'s code; ``notes`` follow the reason."""
    failed = BranchOutcome(status="error", elapsed_ms=0.0, error_class=exc.code.value, detail=exc.message[:200])
    engine = Engine(catalog or Catalog.load(), Policy.from_settings(settings or PipelineSettings()))
    resp = assemble(req, failed_result(fallback_directive, failed), engine)
    reason = f"context service {exc.code.value}: {exc.message}"
    reasons = [reason, *notes, *resp.degraded_reasons]
    return resp.model_copy(update={"degraded": True, "degraded_reasons": reasons})
