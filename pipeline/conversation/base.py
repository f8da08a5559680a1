"""Building blocks shared by the OpenAI and Anthropic conversation models (this package).

Every union in those models is a *tagged* union whose tags start with ``~`` (``~text``,
``~list``, ``~user``): pydantic puts the tag into an error's location, and the ``~`` lets
``clean_path`` drop it again, so an error names the caller's own path
(``messages.2.content.1.image_url.detail``) and nothing of ours.

Limits (ours unless a provider publishes one; the transport's byte limit is tighter still):
    MAX_MESSAGES   10,000 messages per conversation (Anthropic allows 100,000 per request:
                   ``messages`` in https://docs.anthropic.com/en/api/messages)
    MAX_TEXT       2,000,000 characters per text field, as ``shared.wire.models.Message``
    MAX_DATA       32,000,000 characters of base64 per image/audio/file (Anthropic's request
                   size limit is 32 MB: https://docs.anthropic.com/en/api/overview)
    MAX_PARTS      1,000 content parts or blocks per message; MAX_TOOL_CALLS 1,000 per message
    MAX_TOOLS      128 tool definitions (OpenAI: "A max of 128 functions are supported",
                   ``tools`` in https://platform.openai.com/docs/api-reference/chat/create)
    MAX_ID         256 characters per call id (no provider publishes a limit; chosen by us)
    MAX_SHORT      1,000 characters for names, titles, media types and similar labels
    MAX_JSON_DEPTH 32 levels in free-form JSON (schemas, tool inputs), as ``shared/wire/codec.py``
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

MAX_MESSAGES = 10_000
MAX_TEXT = 2_000_000
MAX_DATA = 32_000_000
MAX_PARTS = 1_000
MAX_TOOL_CALLS = 1_000
MAX_TOOLS = 128
MAX_ID = 256
MAX_SHORT = 1_000
MAX_JSON_DEPTH = 32
TAG = "~"

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Data = Annotated[str, StringConstraints(min_length=1, max_length=MAX_DATA)]
Short = Annotated[str, StringConstraints(max_length=MAX_SHORT)]
CallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID)]
# OpenAI function names: "Must be a-z, A-Z, 0-9, or contain underscores and dashes, with a
# maximum length of 64" (https://platform.openai.com/docs/api-reference/chat/create, tools);
# the API enforces the same pattern on a message's ``name``. Anthropic documents the same
# regex for tool names (https://docs.anthropic.com/en/docs/build-with-claude/tool-use).
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class ChatModel(BaseModel):
    """Frozen, strict, closed: a field we do not know is refused, never dropped (dropping it
    would break the byte-faithful round trip the proxy relies on)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def json_problem(obj: Any) -> tuple[str, str] | None:
    """(relative dotted path, why) of the first value that is not plain JSON or nests deeper
    than MAX_JSON_DEPTH, else None. Iterative, so hostile nesting cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 1)]
    while stack:
        cur, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return path, f"nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(cur, float) and not math.isfinite(cur):
            return path, "NaN and infinity are not accepted"
        if isinstance(cur, dict):
            for key, value in cur.items():
                if not isinstance(key, str):
                    return path, "map keys must be strings"
                stack.append((value, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(cur, list):
            stack.extend((v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(cur))
        elif not (cur is None or isinstance(cur, str | int | float | bool)):
            return path, f"a {type(cur).__name__} is not a JSON value"
    return None


class PathError(ValueError):
    """A validator's refusal about a spot below the value it checked (``where``, dotted and
    relative; empty for the value itself), so the reported path points at that spot."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.where = where
        self.why = why


def _plain_json(value: dict[str, Any]) -> dict[str, Any]:
    problem = json_problem(value)
    if problem is not None:
        raise PathError(*problem)
    return value


# A JSON object (tool parameters, tool inputs): strings keys, JSON values, bounded depth.
JsonObject = Annotated[dict[str, Any], AfterValidator(_plain_json)]
Parts = Field(min_length=1, max_length=MAX_PARTS)


def tag_of(field: str, value: Any) -> str | None:
    """The union tag for ``value``: ``~`` + its ``field`` (``type`` or ``role``), read from a
    raw dict or from an already built model."""
    raw = value.get(field) if isinstance(value, dict) else getattr(value, field, None)
    return TAG + raw if isinstance(raw, str) else None


def shape_of(value: Any) -> str | None:
    """Tag for ``str | list[...]`` fields: content is either a string or a list of parts."""
    if isinstance(value, str):
        return TAG + "str"
    if isinstance(value, list):
        return TAG + "list"
    return None


def clean_path(loc: tuple[int | str, ...]) -> str:
    """Dotted path of a pydantic location with our ``~`` union tags removed."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith(TAG)))
