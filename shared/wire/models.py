"""Wire models shared by broker, worker and client (pydantic v2, strict).

Strict mode is deliberate: msgpack already gives us native types, so a string where an int
belongs is a caller bug to report, not something to coerce. NaN and infinity are refused
everywhere (``allow_inf_nan=False``). Identifiers are restricted to a safe alphabet because
they become parts of Redis keys (``{org_id}:directive:{agent_id}``) and must never smuggle a
separator into another tenant's namespace.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from .base import WireModel as _Wire
from .chat_query import last_user_text
from .editing import ContextEditing, MessageEdit
from .errors import ErrorCode

PROTOCOL_VERSION = 1

# Identifiers that end up inside Redis keys and URLs: no ':' or whitespace, bounded length.
IDENT_CHARS = r"[A-Za-z0-9_.\-]{1,64}"  # the one definition; shared.stores.keys.is_ident checks it with fullmatch
Ident = Annotated[str, StringConstraints(pattern=f"^{IDENT_CHARS}$")]
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Unit = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]


class Message(_Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, StringConstraints(max_length=2_000_000)]


COMPONENTS = ("relevance", "recency", "usefulness", "confidence", "access")
_Weight = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class ScoreWeights(_Wire):
    """Weights of the memory composite's five components (spec "Memory-service composite").

    The packer's score of a hit that carries its components is their weighted sum with these
    weights (docs/selection-quality.md). Each finite, non-negative; together they sum to 1. The
    defaults are the packer's (``pipeline.selection.score.DEFAULT_WEIGHTS``), not the memory service's.
    """

    relevance: _Weight = 0.70
    recency: _Weight = 0.10
    usefulness: _Weight = 0.10
    confidence: _Weight = 0.05
    access: _Weight = 0.05

    @model_validator(mode="after")
    def _sums_to_one(self) -> ScoreWeights:
        total = self.relevance + self.recency + self.usefulness + self.confidence + self.access
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"weights must sum to 1, got {total:.6g}")
        return self

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.relevance, self.recency, self.usefulness, self.confidence, self.access)


class AssemblyOptions(_Wire):
    """Per-request switches, and the weights of the packer's score (``weights``, ``score``)."""

    include_directive: bool = True
    include_hot: bool = True
    include_cold: bool = True
    max_memories: Annotated[int, Field(ge=0, le=70)] | None = None
    min_score: Unit = 0.0
    # docs/assembly.md "Chat-native assembly": "derived" keeps the memories block byte-identical for the same
    # memory set (a stable prompt-cache prefix); "random" draws a fresh nonce per assembly.
    nonce: Literal["derived", "random"] = "derived"
    cache_breakpoints: bool = False  # Anthropic only: add cache_control after the stable parts
    # docs/selection-quality.md: the composite's weights for this request (default: the spec's),
    # and the score rule: "composite" (the weighted components each hit carries, the interim
    # score for a hit without them) or "interim" (0.85 x similarity + 0.15 x confidence for all).
    weights: ScoreWeights | None = None
    score: Literal["composite", "interim"] = "composite"


ChatFormat = Literal["openai", "anthropic"]


class HistoryOptions(_Wire):
    """How a chat conversation is fitted to the window (docs/assembly.md "Chat-native assembly")."""

    mode: Literal["trim_oldest", "fail"] = "trim_oldest"
    min_recent_turns: Annotated[int, Field(ge=0, le=10_000)] = 0
    min_memory_share: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.0
    context_editing: ContextEditing = Field(default_factory=ContextEditing)


# Opaque conversation keys (a summary's, docs/assembly.md "Compaction summaries"): the last part of a Redis key,
# after the org and agent, so ':' may appear (it cannot reach another org's or agent's keys).
SUMMARY_KEY_CHARS = r"[A-Za-z0-9._:\-]{1,128}"
MAX_SUMMARY_CHARS = 32_000


class SummarySlot(_Wire):
    """A compaction summary that stands in for the conversation's first ``covers`` non-system
    messages (docs/assembly.md "Compaction summaries"). A count, not message ids: a count is what a proxy
    knows, and a conversation only grows at its end, so its first N non-system messages are the
    same messages call after call. ``covers`` must end on a unit boundary (never between a tool
    call and its results) and before the latest user turn."""

    text: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SUMMARY_CHARS)]
    covers: NonNegInt


class AssembleRequest(_Wire):
    """One assembly. ``query`` may be left out in chat form (``format`` set): it is then the
    latest user message's text (``last_user_text``), as the LiteLLM hook derives it."""

    v: Annotated[int, Field(ge=1)] = PROTOCOL_VERSION
    request_id: RequestId
    org_id: Ident
    agent_id: Ident
    model: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    query: Annotated[str, StringConstraints(max_length=100_000)]
    recent_messages: Annotated[list[Message], Field(max_length=1000)] = Field(default_factory=list)
    tool_schemas: Annotated[list[dict[str, Any]], Field(max_length=256)] = Field(default_factory=list)
    options: AssemblyOptions = Field(default_factory=AssemblyOptions)
    # Chat-native form: the whole conversation in the provider's own shape (validated by
    # pipeline.conversation.parse when the pipeline runs). Exclusive with recent_messages / tool_schemas.
    format: ChatFormat | None = None
    messages: Annotated[list[Any], Field(max_length=10_000)] = Field(default_factory=list)
    system: Any = None
    tools: Annotated[list[Any], Field(max_length=128)] = Field(default_factory=list)
    history: HistoryOptions = Field(default_factory=HistoryOptions)
    # A compaction summary of the conversation's start, or the key the worker loads one by
    # (``{org}:summary:{agent}:{summary_key}``) when the request carries none.
    summary: SummarySlot | None = None
    summary_key: Annotated[str, StringConstraints(pattern=f"^{SUMMARY_KEY_CHARS}$")] | None = None
    # Absolute deadline, Unix epoch nanoseconds (clocks across hosts are assumed NTP-synced).
    deadline_ns: Annotated[int, Field(gt=0)]

    @model_validator(mode="before")
    @classmethod
    def _chat_query(cls, data: Any) -> Any:
        if isinstance(data, dict) and "query" not in data and data.get("format") is not None:
            return {**data, "query": last_user_text(data.get("messages"))}
        return data

    @model_validator(mode="after")
    def _one_form(self) -> AssembleRequest:
        if self.format is None and (self.messages or self.tools or self.system is not None):
            raise ValueError("messages, system and tools need format ('openai' or 'anthropic')")
        if self.format is not None and (self.recent_messages or self.tool_schemas):
            raise ValueError("with format, send the conversation in messages and tools, not recent_messages "
                             "or tool_schemas")
        return self


# ---------------------------------------------------------------------------------------- response

# "summary": the stored summary, read in the directive's round trip (present only with summary_key).
BranchName = Literal["directive", "hot", "cold", "summary"]
BranchStatus = Literal["success", "timeout", "error", "skipped"]
Source = Literal["hot", "cold"]
PackPath = Literal["dp", "greedy", "all_fit", "empty"]
# Why a candidate never reached the packer (the pipeline's rejections); the two other decisions
# are the packer's own.
# below_cutoff: a search candidate just under the memory service's line, shown but never packed.
RejectKind = Literal["invalid_score", "duplicate", "below_floor", "over_cap", "over_limit", "malformed",
                     "below_cutoff"]
DecisionKind = Literal["packed", "excluded_budget", RejectKind]
SectionName = Literal["directive", "summary", "history", "memories", "tools"]


class Section(_Wire):
    name: SectionName
    text: str
    tokens: NonNegInt


class PackedMemory(_Wire):
    memory_id: str
    category: str
    tokens: NonNegInt
    score: Unit
    source: Source


class Decision(_Wire):
    """What happened to one candidate, and why, so "where did my memory go?" has an answer."""

    memory_id: str
    source: Source
    decision: DecisionKind
    reason: str
    tokens: NonNegInt | None = None
    score: Unit | None = None
    components: dict[str, float] | None = None  # the composite's five inputs, when the hit carried them
    # A search hit's stage scores (full text, vector, subject boost; docs/memory-search.md), which its
    # relevance was fused from; a below-cutoff candidate's also hold its relevance and composite.
    retrieval: dict[str, float] | None = None


CountRule = Literal["exact", "estimate", "calibrated"]


class BudgetBreakdown(_Wire):
    """Every term of the spec's usable-budget formula, plus the inputs that produced them.

    ``count_rule`` says which rule produced every count in it (docs/assembly.md "Calibrated token counts"):
    the family's exact BPE, its conservative estimate, or the uncalibrated count times
    ``calibration_ratio`` (the ``calibration_quantile`` of the provider-reported ratio over
    ``calibration_samples`` effective samples of this org and model).
    """

    model: str
    tokenizer_family: str
    estimate_kind: Literal["exact", "estimate"]
    context_window: NonNegInt
    max_output: NonNegInt
    response_reserve: NonNegInt
    safety_buffer: NonNegInt
    directive_tokens: NonNegInt
    messages_tokens: NonNegInt
    tool_schema_tokens: NonNegInt
    formatter_overhead_tokens: NonNegInt
    usable: NonNegInt
    unclamped: int
    constrained: bool
    count_rule: CountRule | None = None  # None only in responses no pipeline made (bench transport)
    calibration_samples: NonNegInt = 0
    calibration_quantile: Unit | None = None
    calibration_ratio: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None


class BranchOutcome(_Wire):
    status: BranchStatus
    elapsed_ms: Annotated[float, Field(ge=0.0)]
    error_class: str | None = None
    detail: str | None = None
    count: NonNegInt = 0


class PackerStats(_Wire):
    path: PackPath
    evaluated: NonNegInt
    excluded_for_budget: NonNegInt
    budget_reached: bool
    total_tokens: NonNegInt
    total_score: Annotated[float, Field(ge=0.0)]
    token_budget: int


class HistoryDecision(_Wire):
    """A message of the conversation left out to fit the window, and why."""

    index: NonNegInt
    role: str
    tokens: NonNegInt
    reason: str


class SummaryReport(_Wire):
    """What became of a request's summary: the messages it covers, its tokens as charged, whether
    it was sent, where it came from, and why not when it was not."""

    covers: NonNegInt
    tokens: NonNegInt
    placed: bool
    source: Literal["request", "stored"]
    reason: str | None = None


class Piece(_Wire):
    """One content block of an assembled message (or of Anthropic's ``system``): block ``ref`` of
    the caller's own content (a string content is one text block) or a new text
    block ``text``; ``cache`` adds ``cache_control: {"type": "ephemeral"}`` to it. ``clear`` (with
    ``ref``): the block cleared (docs/assembly.md "Context editing"): a ``tool_result``'s content
    becomes this text, a ``tool_use``'s input ``{}`` (then ``clear`` is "")."""

    ref: NonNegInt | None = None
    text: str | None = None
    cache: bool = False
    clear: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Piece:
        if (self.ref is None) == (self.text is None):
            raise ValueError("a piece is either ref (a caller block) or text (a new block)")
        if self.clear is not None and self.ref is None:
            raise ValueError("only a caller block (ref) can be cleared")
        return self


class Placed(_Wire):
    """One message of the assembled conversation that is not a caller's message unchanged: caller
    message ``ref`` with its content rebuilt from ``content`` and/or the arguments of its OpenAI
    ``tool_calls`` at ``cleared_calls`` replaced by ``"{}"`` (docs/assembly.md "Context editing"), or a
    new message (``role``, ``text``)."""

    ref: NonNegInt | None = None
    content: list[Piece] | None = None
    role: Literal["system", "developer", "user"] | None = None  # "user": Anthropic's summary-only turn
    text: str | None = None
    cleared_calls: list[NonNegInt] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Placed:
        caller = self.ref is not None and self.role is None and self.text is None \
            and (self.content is not None or self.cleared_calls is not None)
        new = self.ref is None and self.role is not None and self.text is not None \
            and self.content is None and self.cleared_calls is None
        if not (caller or new):
            raise ValueError("a placed message is either ref with content or cleared_calls, or role with text")
        return self


class ChatLayout(_Wire):
    """How the provider-ready conversation is made from the caller's own (docs/assembly.md "Size limits"):
    ``messages`` in order, an int being the caller's message at that index, unchanged; ``system``
    Anthropic's system blocks (None for OpenAI). ``pipeline.conversation.layout.materialize`` applies it."""

    messages: list[NonNegInt | Placed]
    system: list[Piece] | None = None


class AssembleResponse(_Wire):
    v: int = PROTOCOL_VERSION
    request_id: RequestId
    rendered: str
    sections: list[Section]
    packed: list[PackedMemory]
    decisions: list[Decision]
    budget: BudgetBreakdown
    constrained: bool
    branches: dict[BranchName, BranchOutcome]
    packer: PackerStats
    degraded: bool
    degraded_reasons: list[str]
    # Per-stage timings in microseconds: queue_wait, worker_wait, retrieval, budget, scoring,
    # packing, formatting, total (worker-side). Missing keys mean the stage did not run.
    timings_us: dict[str, NonNegInt]
    nonce: str
    worker_id: str = ""
    # Chat-native requests only: what the proxy sends the provider, as is (docs/assembly.md "Chat-native
    # assembly"), its exact (or estimated) token count, and the messages trimmed to fit. On the
    # wire a reply carries ``layout`` alone; the client library rebuilds ``messages`` and
    # ``system`` from the caller's own conversation (``pipeline.conversation.layout``).
    format: ChatFormat | None = None
    messages: list[dict[str, Any]] | None = None
    system: list[dict[str, Any]] | None = None
    layout: ChatLayout | None = None
    prompt_tokens: NonNegInt | None = None
    prompt_tokens_kind: CountRule | None = None
    # What a usage report needs to match the provider's count to this assembly (docs/assembly.md
    # "Calibrated token counts"): the emitted prompt counted by the catalog's rule alone (no
    # calibration; equal to prompt_tokens unless the kind is "calibrated"), and the tenant.
    prompt_tokens_uncalibrated: NonNegInt | None = None
    org_id: str | None = None
    agent_id: str | None = None
    # The id a usage report names: issued by the worker, which keeps its own record of the
    # uncalibrated count under it for a short while; None when nothing was recorded.
    assembly_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    history: list[HistoryDecision] = Field(default_factory=list)
    # Kept messages sent or counted other than as written: cleared tool uses, thinking not charged.
    edits: list[MessageEdit] = Field(default_factory=list)
    # The request's summary (docs/assembly.md "Compaction summaries"), and how many leading non-system
    # messages of the caller's conversation were not sent (summarized or trimmed): the next
    # summary covers at least these.
    summary: SummaryReport | None = None
    history_dropped_upto: NonNegInt = 0
    # Chat requests: tokens before the first part that depends on this turn's retrieval, and the
    # cache_control breakpoints added (paths such as "system.1", "messages.6.content.0").
    stable_prefix_tokens: NonNegInt | None = None
    cache_breakpoints: list[str] = Field(default_factory=list)


class UsageReport(_Wire):
    """The provider's prompt count for one assembly, reported back (protocol USAGE; fire-and-forget).

    ``org_id``/``agent_id`` are authorized by the broker exactly as a request's are; the sample is
    stored under that org only. ``assembly_id`` is the assembly's (the service-issued id); the ratio
    is taken against the service's own record of it, never against ``estimated_tokens`` (the
    assembly's ``prompt_tokens_uncalibrated`` as the caller sends it, informational, and ``model``
    likewise); ``prompt_tokens`` the provider's whole prompt count as the
    window sees it (OpenAI ``usage.prompt_tokens``; Anthropic ``input_tokens`` plus
    ``cache_read_input_tokens`` and ``cache_creation_input_tokens``). ``cached_tokens`` (the part
    served from the provider's prompt cache) is informational and never above ``prompt_tokens``.
    """

    v: Annotated[int, Field(ge=1)] = PROTOCOL_VERSION
    request_id: RequestId  # this report's own id
    org_id: Ident
    agent_id: Ident
    deadline_ns: Annotated[int, Field(gt=0)]  # the broker drops a report it receives after this
    assembly_id: RequestId
    model: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    estimated_tokens: Annotated[int, Field(ge=1, le=100_000_000)]
    prompt_tokens: Annotated[int, Field(ge=1, le=100_000_000)]
    cached_tokens: Annotated[int, Field(ge=0, le=100_000_000)] | None = None

    @model_validator(mode="after")
    def _cached_within(self) -> UsageReport:
        if self.cached_tokens is not None and self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        return self


class ErrorReply(_Wire):
    v: int = PROTOCOL_VERSION
    request_id: str | None = None
    code: Annotated[ErrorCode, Field(strict=False)]  # arrives as a plain string off the wire
    message: str
    field: str | None = None
