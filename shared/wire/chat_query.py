"""The retrieval query of a chat-form request that gives none: its latest user message's text
(README "The client library"); the LiteLLM hook derives its calls' queries the same way."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["CHAT_QUERY_CHARS", "last_user_text"]

# How much of the latest user message a chat-form request without a query searches with.
CHAT_QUERY_CHARS = 2000


def last_user_text(messages: object, limit: int = CHAT_QUERY_CHARS) -> str:
    """The retrieval query of a chat conversation: the text of the latest user message that has
    text (text parts only; an Anthropic user turn of tool results only has none), cut to ``limit``;
    "" when there is none (or ``messages`` is not a list: its validation says what is wrong)."""
    if not isinstance(messages, list):
        return ""
    for msg in reversed(messages):
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
                content = " ".join(t for t in texts if isinstance(t, str))
            if isinstance(content, str) and content:
                return content[:limit]
    return ""
