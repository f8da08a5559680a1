"""Agent directives in Redis, as a versioned JSON envelope at ``{org_id}:directive:{agent_id}``.

    {"text": "...", "version": 3, "updated_at": "2026-11-29T13:54:00.000Z"}

The version lets a reader tell which directive it used (and a cache tell it is stale); it is
bumped atomically by a Lua script, so two writers never hand out the same version. Readers
refuse anything else at the key with ``MalformedDirective``: a directive is an instruction to
the model, and guessing at a damaged one is worse than running without it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..wire.errors import Internal
from ..wire.validation import first_error
from .keys import directive_key

MAX_DIRECTIVE_CHARS = 100_000


class DirectiveEnvelope(BaseModel):
    """What is stored at a directive key. Unknown fields are ignored for forward compatibility."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    text: Annotated[str, StringConstraints(max_length=MAX_DIRECTIVE_CHARS)]
    version: Annotated[int, Field(ge=1)]
    updated_at: AwareDatetime


class MalformedDirective(Internal):
    """The value at a directive key is not a valid envelope (bad JSON, fields or Redis type)."""

    def __init__(self, key: str, detail: str, raw: bytes | str | None = None) -> None:
        super().__init__(f"directive at {key!r} is malformed: {detail}", field="directive")
        self.key = key
        self.raw = raw


# KEYS[1] directive key; ARGV[1] JSON-encoded text; ARGV[2] JSON-encoded updated_at.
# The previous version is read from the stored envelope; a missing or unreadable one counts as 0,
# so an admin can always repair a damaged key by setting it again.
_SET_LUA = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'string' then
  return redis.error_reply('WRONGTYPE directive key holds a ' .. kind)
end
local version = 0
local current = redis.call('GET', KEYS[1])
if current then
  local ok, doc = pcall(cjson.decode, current)
  if ok and type(doc) == 'table' and type(doc['version']) == 'number' and doc['version'] >= 0 then
    version = math.floor(doc['version'])
  end
end
version = version + 1
local envelope = '{"text":' .. ARGV[1] .. ',"version":' .. string.format('%d', version)
  .. ',"updated_at":' .. ARGV[2] .. '}'
redis.call('SET', KEYS[1], envelope)
return envelope
"""


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_envelope(key: str, raw: bytes | str) -> DirectiveEnvelope:
    """Decode one stored envelope; every failure becomes ``MalformedDirective``."""
    try:
        doc: Any = json.loads(raw)
        if not isinstance(doc, dict):
            raise MalformedDirective(key, "not a JSON object", raw)
        return DirectiveEnvelope.model_validate_json(raw)
    except MalformedDirective:
        raise
    except ValidationError as exc:
        err = first_error(exc, root="envelope")
        raise MalformedDirective(key, f"{err.field}: {err.message}", raw) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedDirective(key, f"not JSON ({exc})", raw) from exc


async def get_directive(redis: Redis, org_id: str, agent_id: str) -> DirectiveEnvelope | None:
    """The agent's directive, or ``None`` if it has none.

    Raises ``ValueError`` for a bad org/agent id, ``MalformedDirective`` for a damaged value;
    Redis connection errors propagate for the caller to translate.
    """
    key = directive_key(org_id, agent_id)
    try:
        raw = await redis.get(key)
    except ResponseError as exc:  # e.g. WRONGTYPE: a hash where a string belongs
        raise MalformedDirective(key, str(exc)) from exc
    if raw is None:
        return None
    return parse_envelope(key, raw)


async def set_directive(
    redis: Redis, org_id: str, agent_id: str, text: str, *, now: datetime | None = None
) -> DirectiveEnvelope:
    """Store ``text`` as the agent's directive with the next version; returns the new envelope.

    Raises ``ValueError`` for empty, whitespace-only, oversized or non-Unicode text.
    """
    key = directive_key(org_id, agent_id)
    if not isinstance(text, str) or len(text) > MAX_DIRECTIVE_CHARS:
        raise ValueError(f"directive text must be a string of at most {MAX_DIRECTIVE_CHARS} characters")
    if not text.strip():
        # An empty directive would read as "this agent has instructions" while giving none;
        # deleting the key is how a directive is removed.
        raise ValueError("directive text must not be empty or only whitespace (delete the directive instead)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("directive text is not valid Unicode (lone surrogate)") from exc
    when = now if now is not None else datetime.now(UTC)
    if when.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    script = redis.register_script(_SET_LUA)
    try:
        raw = await script(keys=[key], args=[json.dumps(text, ensure_ascii=False), json.dumps(_iso(when))])
    except ResponseError as exc:
        if "WRONGTYPE" in str(exc):
            raise MalformedDirective(key, str(exc)) from exc
        raise
    return parse_envelope(key, raw)


async def delete_directive(redis: Redis, org_id: str, agent_id: str) -> bool:
    """Remove the agent's directive; ``True`` if there was one."""
    return bool(await redis.delete(directive_key(org_id, agent_id)))
