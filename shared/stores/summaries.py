"""Stored compaction summaries: one STRING per conversation (``shared.stores.keys.summary_key``), the JSON
``{"text": ..., "covers": N}`` (docs/assembly.md "Compaction summaries").

The worker reads it in the directive's round trip when a request names ``summary_key`` and
carries no summary; whoever makes summaries (the LiteLLM hook, off the call path) writes it.
Both sides use these two functions, so there is one format. A stored value is untrusted input:
``decode_summary`` returns a problem instead of raising, and the assembly goes on without it.
"""

from __future__ import annotations

import orjson
from pydantic import ValidationError

from ..wire.models import SummarySlot
from .keys import summary_key

__all__ = ["decode_summary", "encode_summary", "summary_key"]


def encode_summary(text: str, covers: int) -> bytes:
    """The stored value; ``ValueError`` for a summary a request could not carry either."""
    try:
        slot = SummarySlot(text=text, covers=covers)
    except ValidationError as exc:
        raise ValueError(f"not a summary: {exc.errors()[0]['msg']}") from exc
    return orjson.dumps({"text": slot.text, "covers": slot.covers})


def decode_summary(raw: bytes) -> SummarySlot | str:
    """The stored summary, or what is wrong with the value (never raises)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    if not isinstance(doc, dict):
        return f"not a JSON object but {type(doc).__name__}"
    try:  # other fields are the writer's own (metadata a later writer may add): ignored
        return SummarySlot.model_validate({"text": doc.get("text"), "covers": doc.get("covers")})
    except ValidationError as exc:
        err = exc.errors()[0]
        return f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
