"""Load memories and directives from JSONL straight into Redis (an admin tool, not an API client).

    ibex-context seed [--file F.jsonl] [--redis-url URL] [--flush-orgs] [--embedder minilm|static|hash]

(``python -m ibex_context.memory.service.seed`` is the same tool.) The Redis URL comes from ``--redis-url``, else
``IBEX_REDIS_URL``, else the one ``make up`` recorded in ``.run/`` (README "Quickstart").

Without ``--file`` the bundled demo dataset (``memory/data/demo.jsonl``) is loaded. One JSON
object per line; blank lines and lines starting with ``#`` are skipped (every field: docs/seed.md):

    {"kind": "memory", "org_id": "acme", "agent_id": "support-bot", "content": "...",
     "category": "preference", "confidence": 0.9, "usefulness": 0.6, "access_count": 3,
     "age_days": 12.5, "hot": true, "salience": 0.8, "memory_id": "optional"}
    {"kind": "directive", "org_id": "acme", "agent_id": "support-bot", "text": "..."}

``kind`` defaults to ``memory``. ``age_days`` (relative to the moment of seeding, so a demo never
goes stale) or an ISO ``created_at``; without either, now. Without ``memory_id`` one is derived
from org, agent and content, so seeding the same file twice overwrites rather than duplicates.
Every line is validated before anything is written. Vectors are computed with the configured
embedder (``IBEX_MEMORY_EMBEDDER``); the service backfills any it lacks. Directives get the next
version at every seed. ``--flush-orgs`` first deletes every key of the orgs named in the file.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import Field, ValidationError, field_validator
from redis.asyncio import Redis

from ...shared.config.cliargs import CliParser, settings_error, utf8_arg
from ...shared.stores.connect import REDIS_ERRORS, async_client
from ...shared.stores.directives import MAX_DIRECTIVE_CHARS, set_directive
from ...shared.stores.keys import org_key_patterns
from ...shared.wire.models import Ident
from ...shared.wire.validation import first_error
from ..embedded_redis.server import default_redis_url
from ..embedders.embed import EMBEDDERS, Embedder, Vectors, load_embedder
from ..embedders.token_states import Embedded
from ..search.index import QueryEngineMissing, ensure_index
from ..store.records import MemoryRecord, StrictModel
from ..store.writes import NewMemory, write_memories
from .config import MemoryConfig
from .models import WriteMemory

DEMO_FILE = Path(__file__).resolve().parents[1] / "data" / "demo.jsonl"


class SeedMemory(WriteMemory):
    kind: Literal["memory"] = "memory"
    org_id: Ident
    age_days: Annotated[float, Field(ge=0.0, le=36_500.0, allow_inf_nan=False)] | None = None


class SeedDirective(StrictModel):
    kind: Literal["directive"]
    org_id: Ident
    agent_id: Ident
    text: Annotated[str, Field(max_length=MAX_DIRECTIVE_CHARS)]

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        """Refused here, before anything is written, rather than by ``set_directive`` mid-seed."""
        if not v.strip():
            raise ValueError("a directive cannot be empty or only whitespace")
        return v


class SeedError(ValueError):
    """A record that cannot be seeded; ``where`` names its line."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass(frozen=True, slots=True)
class SeedStats:
    memories: int
    hot: int
    directives: int
    orgs: tuple[str, ...]


def derived_memory_id(org_id: str, agent_id: str, content: str) -> str:
    digest = hashlib.sha256(f"{org_id}\0{agent_id}\0{content}".encode()).hexdigest()[:20]
    return f"m-{digest}"


def parse_records(
    records: Iterable[tuple[str, Mapping[str, Any]]], *, now: datetime
) -> tuple[list[NewMemory], list[SeedDirective]]:
    """Validate every ``(where, record)`` pair; ``SeedError`` on the first bad one."""
    memories: list[NewMemory] = []
    directives: list[SeedDirective] = []
    for where, raw in records:
        if not isinstance(raw, Mapping):
            raise SeedError(where, "each record must be a JSON object")
        try:
            if raw.get("kind") == "directive":
                directives.append(SeedDirective.model_validate(dict(raw)))
                continue
            m = SeedMemory.model_validate(dict(raw))
        except ValidationError as exc:
            err = first_error(exc, root="record")
            raise SeedError(where, f"{err.field}: {err.message}") from exc
        if m.age_days is not None and m.created_at is not None:
            raise SeedError(where, "give age_days or created_at, not both")
        created = m.created_at or (now - timedelta(days=m.age_days or 0.0))
        record = MemoryRecord(
            memory_id=m.memory_id or derived_memory_id(m.org_id, m.agent_id, m.content),
            content=m.content, category=m.category, confidence=m.confidence, usefulness=m.usefulness,
            access_count=m.access_count, created_at=created,
            salience=m.salience if m.salience is not None else m.confidence, subject=m.subject,
        )
        memories.append(NewMemory(m.org_id, m.agent_id, record, m.hot))
    return memories, directives


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                out.append((f"{path.name}:{n}", json.loads(line, parse_constant=_no_nan)))
            except ValueError as exc:
                raise SeedError(f"{path.name}:{n}", f"not JSON ({exc})") from exc
    return out


def _no_nan(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


async def flush_orgs(redis: Redis, orgs: Iterable[str]) -> int:
    """Delete every key of each org (SCAN, not KEYS: safe on a shared server)."""
    removed = 0
    for org in orgs:
        batch: list[bytes] = []
        for pattern in org_key_patterns(org):
            async for key in redis.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) >= 500:
                    removed += int(await redis.delete(*batch))
                    batch = []
        if batch:
            removed += int(await redis.delete(*batch))
    return removed


async def seed_records(
    redis: Redis,
    records: Iterable[Mapping[str, Any]] | Iterable[tuple[str, Mapping[str, Any]]],
    *,
    embedder: Embedder | None = None,
    now: datetime | None = None,
    flush: bool = False,
) -> SeedStats:
    """Validate then write memories and directives; records may be bare or ``(where, record)``."""
    pairs = [r if isinstance(r, tuple) else (f"record {i + 1}", r) for i, r in enumerate(records)]
    memories, directives = parse_records(pairs, now=now or datetime.now(UTC))
    orgs = tuple(sorted({m.org_id for m in memories} | {d.org_id for d in directives}))
    if embedder is None:
        cfg = MemoryConfig()  # IBEX_MEMORY_EMBEDDER and its settings, as the service reads them
        embedder = load_embedder(cfg.embedder, cfg.embedder_config())
    emb = embedder

    with_states = getattr(emb, "embed_with_states", None)
    embed_many = with_states if callable(with_states) else emb.embed  # token states from the same pass

    async def embed(texts: Any) -> Vectors | Embedded:
        if emb.blocking:
            return cast("Vectors | Embedded", await asyncio.to_thread(embed_many, texts))
        return cast("Vectors | Embedded", embed_many(texts))

    if flush:
        await flush_orgs(redis, orgs)
    for org, agent in sorted({(m.org_id, m.agent_id) for m in memories}):  # indexes first: writes indexed as they land
        await ensure_index(redis, emb.name, emb.dim, org, agent)
    await write_memories(redis, memories, embedder_name=emb.name, embed=embed)
    for d in directives:
        await set_directive(redis, d.org_id, d.agent_id, d.text, now=now)
    return SeedStats(len(memories), sum(m.hot for m in memories), len(directives), orgs)


async def _main(path: Path, url: str, *, flush: bool, embedder: str | None) -> SeedStats:
    client = async_client(url, socket_timeout=10, socket_connect_timeout=5)
    try:
        emb = load_embedder(embedder, MemoryConfig().embedder_config()) if embedder else None
        return await seed_records(client, read_jsonl(path), embedder=emb, flush=flush)
    finally:
        await client.aclose()


def build_parser(prog: str = "python -m ibex_context.memory.service.seed") -> argparse.ArgumentParser:
    ap = CliParser(prog=prog, description="Load memories and directives from JSONL into Redis "
                                          "(every line is validated before anything is written).",
                   epilog="The file's format, every field with its type and an example: "
                          "docs/seed.md (example: examples/seed.jsonl).")
    ap.add_argument("--file", type=Path, default=DEMO_FILE,
                    help=f"JSONL to load (default: the bundled demo data, memory/data/{DEMO_FILE.name})")
    ap.add_argument("--redis-url", default=None, type=utf8_arg,
                    help="default: $IBEX_REDIS_URL, else the running stack's Redis (.run/redis-url)")
    ap.add_argument("--flush-orgs", action="store_true", help="first delete all keys of the orgs in the file")
    ap.add_argument("--embedder", choices=list(EMBEDDERS), default=None,
                    help="vectors to store (default: $IBEX_MEMORY_EMBEDDER, as the memory service)")
    return ap


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None, *, prog: str = "python -m ibex_context.memory.service.seed") -> int:
    """Seed one file; ``prog`` is how the tool names itself (``ibex-context seed`` via the CLI)."""
    args = build_parser(prog).parse_args(argv)
    try:
        url, source = default_redis_url(args.redis_url)
    except ValidationError as exc:  # a malformed IBEX_* variable
        return _fail(prog, settings_error(exc), 2)
    if not url:
        return _fail(prog, "no Redis to seed: pass --redis-url, set IBEX_REDIS_URL, "
                           "or start the stack with `make up`", 2)
    try:
        stats = asyncio.run(_main(args.file, url, flush=args.flush_orgs, embedder=args.embedder))
    except SeedError as exc:
        return _fail(prog, str(exc), 2)
    except QueryEngineMissing as exc:
        return _fail(prog, f"Redis at {url} ({source}): {exc}", 1)
    except UnicodeDecodeError as exc:
        return _fail(prog, f"--file {args.file}: not valid UTF-8 ({exc.reason})", 2)
    except OSError as exc:
        return _fail(prog, f"--file {args.file}: {exc.strerror or exc}", 2)
    except REDIS_ERRORS as exc:
        return _fail(prog, f"Redis at {url} ({source}): {exc}", 1)
    except ValidationError as exc:  # IBEX_MEMORY_* settings of the embedder (before ValueError)
        return _fail(prog, settings_error(exc, "IBEX_MEMORY_"), 2)
    except ValueError as exc:  # an unparseable Redis URL
        return _fail(prog, f"Redis URL {url!r} ({source}): {exc}", 2)
    print(json.dumps({"memories": stats.memories, "hot": stats.hot, "directives": stats.directives,
                      "orgs": list(stats.orgs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
