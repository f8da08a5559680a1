"""The LiteLLM hook's context editing: the key's metadata, else the team's, else the route's, else
the config's ``history.context_editing`` (docs/litellm.md; no LiteLLM import here)."""

from __future__ import annotations

from typing import Any

from ibex_context.client.integrations.litellm.config import (
    Caller,
    Denied,
    context_editing_for,
    parse_config,
    resolve_identity,
)
from ibex_context.client.integrations.litellm.routes import request_form

CONFIG = parse_config({"orgs": {"acme": {}}, "history": {"context_editing": {"keep": 2}},
                       "context_editing_routes": {"messages": {"keep": 4, "clear_tool_inputs": True}}})


def _who(key: dict[str, Any], team: dict[str, Any] | None = None) -> Caller | Denied:
    who = resolve_identity(CONFIG, {"key": {"ibex_org": "acme", "ibex_agent": "bot", **key}, "team": team or {}})
    assert isinstance(who, Caller | Denied)
    return who


def test_key_then_team_then_route_then_config() -> None:
    plain = _who({})
    assert isinstance(plain, Caller)
    assert context_editing_for(CONFIG, plain, "chat_completions").context_editing.keep == 2
    route = context_editing_for(CONFIG, plain, "messages").context_editing
    assert route.keep == 4 and route.clear_tool_inputs
    team = _who({}, {"ibex_context_editing": {"keep": 5}})
    assert isinstance(team, Caller) and context_editing_for(CONFIG, team, "messages").context_editing.keep == 5
    key = _who({"ibex_context_editing": {"keep": 6, "exclude_tools": ["memory"]}},
               {"ibex_context_editing": {"keep": 5}})
    assert isinstance(key, Caller)
    editing = context_editing_for(CONFIG, key, "responses").context_editing
    assert editing.keep == 6 and editing.exclude_tools == ["memory"]


def test_a_bad_metadata_value_is_denied_naming_the_field() -> None:
    who = _who({"ibex_context_editing": {"keep": -1}})
    assert isinstance(who, Denied) and "ibex_context_editing: keep" in who.reason
    assert isinstance(_who({"ibex_context_editing": "off"}), Denied)


def test_each_route_is_named_on_its_form() -> None:
    chat = request_form("acompletion", {"messages": [{"role": "user", "content": "hi"}]})
    claude = request_form("anthropic_messages", {"messages": [{"role": "user", "content": "hi"}]})
    assert not isinstance(chat, str) and chat.route == "chat_completions"
    assert not isinstance(claude, str) and claude.route == "messages"
