"""Prompt tokens of a chat request as the provider will count it, from the provider's own JSON.

Inputs are plain dicts in the provider's shape (OpenAI Chat Completions ``messages``/``tools``;
Anthropic Messages ``system``/``messages``/``tools``), validated elsewhere. Text is counted with the
``TokenCounter`` given (exact for OpenAI encodings, a conservative estimate for Claude); what the
providers add around the text follows their published guidance, and where they publish nothing we
charge a conservative constant, named and explained below. Every count is an int >= 0, and the same
input always gives the same count (JSON is serialised with sorted keys and compact separators).

OpenAI source: the OpenAI Cookbook, "How to count tokens with tiktoken", sections 6 and 7
(https://cookbook.openai.com/examples/how_to_count_tokens_with_tiktoken): 3 tokens per message,
1 per name, 3 to prime the reply, and ``num_tokens_for_tools``'s constants for function definitions.
Anthropic source: "Tool use with Claude", section "Pricing" (the tool use system prompt table),
https://docs.anthropic.com/en/docs/agents-and-tools/tool-use/overview#pricing.
Image formulas and their sources: ``pipeline/counting/image_tokens.py``.

Thinking (Anthropic): "previous thinking blocks are automatically stripped from the context window
calculation by the Anthropic API", ``context_window = (input_tokens - previous_thinking_tokens) +
current_turn_tokens``, and the thinking of the current tool-use loop "counts as part of the context
window" (https://docs.claude.com/en/docs/build-with-claude/context-windows, "The context window with
extended thinking" and "... with extended thinking and tool use"). Which models strip is per model:
the extended-thinking guide lists Claude Opus 4.5 and later Opus, and Sonnet 4.6 and later, as
keeping every earlier turn's thinking. So for the models in ``THINKING_STRIPPED`` the thinking and
redacted_thinking blocks of messages before the latest user turn (a user message that is not only
tool results: a new turn, after which the API "ignores and strips" earlier thinking) count zero;
those after it, the current tool loop that must be passed back unmodified, count in full. Every
other model, and a request that names none, counts all thinking in full (never an undercount).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...shared.wire.errors import InvalidRequest
from .image_tokens import (
    anthropic_image_tokens,
    image_size,
    model_key,
    openai_image_tokens,
)
from .tokens import TokenCounter

__all__ = [
    "anthropic_image_tokens",
    "anthropic_message_tokens",
    "anthropic_prompt_tokens",
    "anthropic_thinking_tokens",
    "image_size",
    "openai_image_tokens",
    "openai_message_tokens",
    "openai_prompt_tokens",
    "openai_tools_tokens",
]

# --- OpenAI constants (cookbook) -----------------------------------------------------------------
TOKENS_PER_MESSAGE = 3  # <|start|>{role/name}\n{content}<|end|>\n
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3  # every reply is primed with <|start|>assistant<|message|>
# Not published: the cookbook counts no tool calls. Each call is charged its id, name and
# arguments plus this allowance for the framing around it (a recipient header such as
# "to=functions.NAME" and a content type, a few tokens each), about three times what that framing
# plausibly costs. Chosen, not measured.
TOOL_CALL_OVERHEAD = 12


@dataclass(frozen=True, slots=True)
class FunctionCosts:
    """``num_tokens_for_tools``'s constants: per function, per property block, per property key,
    per enum list (negative in the cookbook), per enum item, and once after all functions."""

    func_init: int
    prop_init: int
    prop_key: int
    enum_init: int
    enum_item: int
    func_end: int


_GPT4O_FUNCTIONS = FunctionCosts(7, 3, 3, -3, 3, 12)  # the cookbook's gpt-4o, gpt-4o-mini
_GPT4_FUNCTIONS = FunctionCosts(10, 3, 3, -3, 3, 12)  # the cookbook's gpt-3.5-turbo, gpt-4
# Models the cookbook does not list get the larger set (gpt-4's): func_init 10 instead of 7.
_FUNCTION_COSTS = {"gpt-4o": _GPT4O_FUNCTIONS, "gpt-4o-mini": _GPT4O_FUNCTIONS}

# --- Anthropic constants -------------------------------------------------------------------------
# Tool use system prompt tokens, from the table cited above; per model the larger of its
# "auto/none" and "any/tool" rows, since the tool_choice may change between calls. A model not in
# the table gets the table's largest figure (Claude 3 Opus, auto: 530).
_TOOL_SYSTEM_PROMPT = {
    "claude-opus-4": 346, "claude-opus-4-1": 346, "claude-opus-4-5": 346,
    "claude-sonnet-4": 346, "claude-sonnet-4-5": 346, "claude-3-7-sonnet": 346,
    "claude-haiku-4-5": 346, "claude-3-5-haiku": 340, "claude-3-haiku": 340,
    "claude-3-opus": 530, "claude-3-sonnet": 235,
}
TOOL_SYSTEM_PROMPT_MAX = 530
# Models whose earlier turns' thinking the API strips from the context window (module docstring):
# the extended-thinking guide's "keep only the last assistant turn's thinking" models. A model not
# listed (Claude Opus 4.5 and later Opus, Sonnet 4.6 and later, or one we do not know) is charged
# every thinking block.
THINKING_STRIPPED = frozenset({
    "claude-opus-4", "claude-opus-4-1", "claude-sonnet-4", "claude-sonnet-4-5", "claude-3-7-sonnet",
    "claude-haiku-4-5", "claude-3-5-haiku", "claude-3-5-sonnet", "claude-3-haiku", "claude-3-opus",
    "claude-3-sonnet",
})
THINKING_KINDS = ("thinking", "redacted_thinking")
# Anthropic publishes no per-message, per-block or per-definition framing. These allowances are
# chosen (not measured) to exceed the role markers and tags each piece plausibly renders as
# ("\n\nHuman: ", a tool call's invoke/parameter tags, a result's wrapper). The claude family's
# text counts are themselves estimates already scaled up (catalog estimate_factor 1.25).
MESSAGE_OVERHEAD = 8
TOOL_USE_OVERHEAD = 32
TOOL_RESULT_OVERHEAD = 24
TOOL_DEFINITION_OVERHEAD = 16
# Anthropic-defined tools (a ``type`` such as "bash_20250124" or "computer_20250124") bring their
# own instructions. We did not find one published figure for all of them, so each is charged this
# allowance on top of its JSON, chosen above any single tool's addition we know of.
ANTHROPIC_TYPED_TOOL_ALLOWANCE = 1500


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, compact separators, non-ASCII kept (tokens, not escapes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _text_or_json(counter: TokenCounter, value: Any) -> int:
    if value is None:
        return 0
    return counter.count(value if isinstance(value, str) else canonical_json(value))


# --- OpenAI --------------------------------------------------------------------------------------


def openai_message_tokens(message: dict[str, Any], counter: TokenCounter, *, model: str,
                          path: str = "message") -> int:
    """One Chat Completions message with its framing, as the cookbook counts it: 3 per message,
    every string field's tokens (role, content, name, tool_call_id, ...), 1 more for a name; plus
    content parts, tool calls and images, which the cookbook leaves out."""
    n = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if key == "content":
            n += _openai_content(value, counter, model=model, path=f"{path}.content")
        elif key == "tool_calls":
            n += sum(_openai_tool_call(call, counter) for call in value or ())
        elif key == "function_call":  # the deprecated single-call form
            n += _openai_tool_call({"function": value}, counter) if value else 0
        else:
            n += _text_or_json(counter, value)
            if key == "name":
                n += TOKENS_PER_NAME
    return n


def _openai_content(content: Any, counter: TokenCounter, *, model: str, path: str) -> int:
    if content is None or isinstance(content, str):
        return _text_or_json(counter, content)
    return sum(_openai_part(part, counter, model=model, path=f"{path}.{i}") for i, part in enumerate(content))


def _openai_part(part: dict[str, Any], counter: TokenCounter, *, model: str, path: str) -> int:
    kind = part.get("type")
    if kind == "text":
        return counter.count(part.get("text") or "")
    if kind == "refusal":
        return counter.count(part.get("refusal") or "")
    if kind == "image_url":
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, dict) else None
        width, height = image_size(part) or (None, None)
        return openai_image_tokens(width, height, detail or "auto", model=model)
    if kind in ("input_audio", "file"):
        # OpenAI publishes no token formula for audio or file input that can be applied offline,
        # so we refuse to guess rather than risk an over-window request.
        raise InvalidRequest(f"{path}: {kind} parts cannot be counted offline (OpenAI publishes no "
                             "token formula for them); send the content as text or leave it out", field=path)
    raise InvalidRequest(f"{path}: unknown content part type {kind!r}", field=path)


def _openai_tool_call(call: dict[str, Any], counter: TokenCounter) -> int:
    """A call's id, name and arguments (or a custom tool's input) plus the framing allowance."""
    body = call.get("function") or call.get("custom") or {}
    payload = body.get("arguments", body.get("input"))
    return (TOOL_CALL_OVERHEAD + _text_or_json(counter, call.get("id"))
            + _text_or_json(counter, body.get("name")) + _text_or_json(counter, payload))


def openai_tools_tokens(tools: Sequence[dict[str, Any]], counter: TokenCounter, *, model: str) -> int:
    """Function definitions as the cookbook's ``num_tokens_for_tools`` counts them. Schema parts
    the cookbook does not model (nested objects, array items, formats, non-function tools) are
    charged as their JSON, so they are never free."""
    if not tools:
        return 0
    costs = _FUNCTION_COSTS.get(model_key(model), _GPT4_FUNCTIONS)
    n = 0
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            n += costs.func_init + counter.count(canonical_json(tool))
            continue
        n += costs.func_init + _function_tokens(function, counter, costs)
    return max(0, n + costs.func_end)


def _strip_period(text: str) -> str:
    return text[:-1] if text.endswith(".") else text


def _function_tokens(function: dict[str, Any], counter: TokenCounter, costs: FunctionCosts) -> int:
    n = counter.count(f"{function.get('name', '')}:{_strip_period(function.get('description') or '')}")
    params = function.get("parameters") or {}
    properties = params.get("properties") or {}
    if properties:
        n += costs.prop_init
        for key, prop in properties.items():
            n += costs.prop_key + _property_tokens(key, prop, counter, costs)
    extra = {k: v for k, v in params.items() if k not in ("type", "properties", "required")}
    return n + (counter.count(canonical_json(extra)) if extra else 0)


def _property_tokens(key: str, prop: dict[str, Any], counter: TokenCounter, costs: FunctionCosts) -> int:
    p_type = prop.get("type", "")
    p_type = p_type if isinstance(p_type, str) else canonical_json(p_type)
    n = counter.count(f"{key}:{p_type}:{_strip_period(prop.get('description') or '')}")
    if "enum" in prop:
        items = prop["enum"] or []
        enum = costs.enum_init + sum(costs.enum_item + _text_or_json(counter, item) for item in items)
        n += max(0, enum)  # an empty enum list is never a discount
    extra = {k: v for k, v in prop.items() if k not in ("type", "description", "enum")}
    return n + (counter.count(canonical_json(extra)) if extra else 0)


def openai_prompt_tokens(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                         counter: TokenCounter, *, model: str) -> int:
    """The whole prompt: every message, the reply priming, and the tool definitions."""
    n = sum(openai_message_tokens(m, counter, model=model, path=f"messages.{i}") for i, m in enumerate(messages))
    return n + REPLY_PRIMING + openai_tools_tokens(tools, counter, model=model)


# --- Anthropic -----------------------------------------------------------------------------------


def strips_prior_thinking(model: str | None) -> bool:
    """Whether the API leaves earlier turns' thinking out of ``model``'s window (``THINKING_STRIPPED``)."""
    return model is not None and model_key(model) in THINKING_STRIPPED


def latest_turn(messages: Sequence[dict[str, Any]]) -> int | None:
    """Index of the latest user turn: the last user message with content other than tool results
    (a string content is one text block). None when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if not isinstance(content, list) or any(not (isinstance(b, dict) and b.get("type") == "tool_result")
                                                for b in content):
            return i
    return None


def anthropic_prompt_tokens(system: str | Sequence[dict[str, Any]] | None, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]], counter: TokenCounter, *,
                            model: str | None = None) -> int:
    """System, messages and tools of a Messages request; ``model`` picks the tool use system prompt
    figure (None: the largest published one) and whether earlier turns' thinking counts (None: it does)."""
    n = 0
    if system:
        n += MESSAGE_OVERHEAD + _anthropic_content(system, counter, "system")
    latest = latest_turn(messages) if strips_prior_thinking(model) else None
    for i, message in enumerate(messages):
        n += anthropic_message_tokens(message, counter, path=f"messages.{i}",
                                      free_thinking=latest is not None and i < latest)
    return n + anthropic_tools_tokens(tools, counter, model=model)


def anthropic_message_tokens(message: dict[str, Any], counter: TokenCounter, *, path: str = "messages.0",
                             free_thinking: bool = False) -> int:
    """One message with its allowance; with ``free_thinking`` (a message before the latest user
    turn, for a model in ``THINKING_STRIPPED``) its thinking blocks count zero."""
    n = MESSAGE_OVERHEAD + _anthropic_content(message.get("content"), counter, f"{path}.content")
    return n - anthropic_thinking_tokens(message, counter) if free_thinking else n


def anthropic_thinking_tokens(message: dict[str, Any], counter: TokenCounter) -> int:
    """Tokens of a message's thinking and redacted_thinking blocks, as ``_anthropic_block`` counts them."""
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(_anthropic_block(b, counter, "") for b in content
               if isinstance(b, dict) and b.get("type") in THINKING_KINDS)


def anthropic_tools_tokens(tools: Sequence[dict[str, Any]], counter: TokenCounter, *,
                           model: str | None = None) -> int:
    """Definitions (name, description, input_schema as JSON) plus the tool use system prompt,
    which Anthropic adds whenever at least one tool is given."""
    if not tools:
        return 0
    prompt = _TOOL_SYSTEM_PROMPT.get(model_key(model), TOOL_SYSTEM_PROMPT_MAX) if model else TOOL_SYSTEM_PROMPT_MAX
    n = prompt
    for tool in tools:
        definition = {k: v for k, v in tool.items() if k != "cache_control"}
        n += TOOL_DEFINITION_OVERHEAD + counter.count(canonical_json(definition))
        if tool.get("type", "custom") != "custom":
            n += ANTHROPIC_TYPED_TOOL_ALLOWANCE
    return n


def _anthropic_content(content: Any, counter: TokenCounter, path: str) -> int:
    if content is None or isinstance(content, str):
        return _text_or_json(counter, content)
    return sum(_anthropic_block(block, counter, f"{path}.{i}") for i, block in enumerate(content))


def _anthropic_block(block: dict[str, Any], counter: TokenCounter, path: str) -> int:
    kind = block.get("type")
    if kind == "text":  # citations of an earlier answer may be shown to the model again: charged
        return counter.count(block.get("text") or "") + _text_or_json(counter, block.get("citations") or None)
    if kind == "image":
        width, height = image_size(block) or (None, None)
        return anthropic_image_tokens(width, height)
    if kind == "tool_use":
        return (TOOL_USE_OVERHEAD + _text_or_json(counter, block.get("id")) + _text_or_json(counter, block.get("name"))
                + counter.count(canonical_json(block.get("input", {}))))
    if kind == "tool_result":
        return (TOOL_RESULT_OVERHEAD + _text_or_json(counter, block.get("tool_use_id"))
                + _anthropic_content(block.get("content"), counter, f"{path}.content"))
    if kind == "thinking":
        return counter.count(block.get("thinking") or "")
    if kind == "redacted_thinking":  # encrypted; its length is the only size we can see
        return counter.count(block.get("data") or "")
    if kind == "document":
        return _anthropic_document(block, counter, path)
    raise InvalidRequest(f"{path}: unknown content block type {kind!r}", field=path)


def _anthropic_document(block: dict[str, Any], counter: TokenCounter, path: str) -> int:
    """Plain-text and inline-content documents are counted; PDFs and URLs are refused: their page
    count (and so their tokens) is unknown here."""
    source = block.get("source") or {}
    n = _text_or_json(counter, block.get("title")) + _text_or_json(counter, block.get("context"))
    if source.get("type") == "text":
        return n + counter.count(source.get("data") or "")
    if source.get("type") == "content":
        return n + _anthropic_content(source.get("content"), counter, f"{path}.source.content")
    raise InvalidRequest(f"{path}: a {source.get('type')!r} document cannot be counted offline (its pages are "
                         "unknown here); send its text as a text document or leave it out", field=path)
