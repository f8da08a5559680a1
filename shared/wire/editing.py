"""Wire models of context editing (docs/assembly.md "Context editing"): the request's policy
(``history.context_editing``) and the reply's per-message ``edits``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from .base import WireModel as _Wire

NonNegInt = Annotated[int, Field(ge=0)]
ToolName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class ContextEditing(_Wire):
    """Clear before drop (docs/assembly.md "Context editing"): when the conversation is over what
    it may use, or over ``trigger_tokens``, the oldest tool results are replaced by a short
    placeholder before any whole turn is dropped. The last ``keep`` tool uses and the tools named
    in ``exclude_tools`` are never cleared; clearing happens ``clear_at_least`` tokens at a time
    (fewer clear nothing), so the prompt's cached prefix survives the turns in between.
    ``clear_tool_inputs`` also empties the cleared calls' inputs; ``clear_thinking`` also removes
    the thinking blocks of Anthropic turns before the latest user turn."""

    enabled: bool = True
    trigger_tokens: Annotated[int, Field(ge=0)] | None = None  # None: only when over the budget
    keep: Annotated[int, Field(ge=0, le=10_000)] = 3
    clear_at_least: Annotated[int, Field(ge=0, le=10_000_000)] = 1024
    exclude_tools: Annotated[list[ToolName], Field(max_length=128)] = Field(default_factory=list)
    clear_tool_inputs: bool = False
    clear_thinking: bool = False
    step_share: Annotated[float, Field(ge=0, le=1)] = 0.5


EditAction = Literal["cleared", "thinking_free", "thinking_counted"]


class MessageEdit(_Wire):
    """A kept message sent or counted other than as the caller wrote it (docs/assembly.md "Context
    editing"): ``cleared`` (tool results, inputs or thinking replaced; ``tokens`` saved),
    ``thinking_free`` (Anthropic thinking of an earlier turn, which the provider leaves out of the
    window: ``tokens`` not charged) or ``thinking_counted`` (thinking charged in full: ``tokens``)."""

    index: NonNegInt
    role: str
    action: EditAction
    tokens: NonNegInt
    reason: str
