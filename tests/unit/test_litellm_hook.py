"""The LiteLLM hook's pure parts: config, identity mapping, model names, the pass-through setting.

The proxy itself is exercised end to end in tests/stack/test_litellm_proxy.py; here the hook is called
directly with LiteLLM's own ``UserAPIKeyAuth`` where no stack is needed (nothing is assembled).

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_litellm_hook.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import HTTPException
from litellm.proxy._types import UserAPIKeyAuth

from ibex_context.client import AssembleRequest, Unavailable, degraded_response
from ibex_context.client.integrations.litellm import IbexContextHook
from ibex_context.client.integrations.litellm.config import (
    Caller,
    Denied,
    HookConfigError,
    ModelNotMapped,
    Unmapped,
    load_config,
    map_model,
    parse_config,
    resolve_identity,
)
from ibex_context.client.integrations.litellm.core import HookCore, header_value, headers, last_user_text, record
from ibex_context.client.integrations.litellm.degraded import DirectiveCopies
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.shared.security import auth

CATALOG = Catalog.load()
BASE: dict[str, Any] = {"orgs": {"acme": {}, "globex": {}}, "endpoints": ["tcp://127.0.0.1:1"]}


def _cfg(**over: Any) -> Any:
    return parse_config({**BASE, **over})


@pytest.mark.parametrize(("requested", "deployments", "expected"), [
    ("gpt-4o", [], "gpt-4o"),
    ("openai/gpt-4o", [], "gpt-4o"),
    ("anthropic/claude-sonnet-4", [], "claude-sonnet-4"),
    ("my-claude", ["anthropic/claude-sonnet-4-20250514"], "claude-sonnet-4"),
    ("team-gpt", ["openai/gpt-4o", "azure/gpt-4"], "gpt-4"),  # the smallest window serves any deployment
])
def test_litellm_model_names_map_onto_the_catalog(requested: str, deployments: list[str], expected: str) -> None:
    assert map_model(_cfg(), CATALOG, requested, deployments) == expected


def test_the_config_alias_wins_and_is_checked() -> None:
    cfg = _cfg(models={"fast": "openai/gpt-4o-mini", "typo": "gpt-4oo"})
    assert map_model(cfg, CATALOG, "fast", ["openai/some-deployment"]) == "gpt-4o-mini"
    with pytest.raises(ModelNotMapped, match=r"models\.typo in the ibex-context hook config: model 'gpt-4oo'"):
        map_model(cfg, CATALOG, "typo", [])


def test_an_unknown_model_names_the_deployment_and_the_fix() -> None:
    with pytest.raises(ModelNotMapped) as exc:
        map_model(_cfg(), CATALOG, "mystery", ["openai/mystery-9"])
    assert "deployment 'openai/mystery-9' of 'mystery'" in exc.value.message
    assert "models: in IBEX_LITELLM_CONFIG" in exc.value.message and exc.value.field == "model"


def test_identity_comes_from_key_then_team_metadata() -> None:
    cfg = _cfg()
    key = {"ibex_org": "acme", "ibex_agent": "support-bot"}
    assert resolve_identity(cfg, {"key": key, "team": {"ibex_org": "globex"}}) == Caller("acme", "support-bot")
    team = {"ibex_org": "globex", "ibex_agent": "research-agent"}
    assert resolve_identity(cfg, {"key": {}, "team": team}) == Caller("globex", "research-agent")
    # request metadata is not a source unless configured: a caller cannot name its org
    who = resolve_identity(cfg, {"key": {"ibex_agent": "a"}, "request": {"ibex_org": "acme"}})
    assert isinstance(who, Unmapped) and "no ibex_org in the key or team metadata" in who.reason


@pytest.mark.parametrize(("sources", "reason"), [
    ({"key": {"ibex_org": "acme:x", "ibex_agent": "a"}}, "key metadata ibex_org is not an org id"),
    ({"key": {"ibex_org": "initech", "ibex_agent": "a"}}, "org 'initech' has no client key"),
    ({"key": {"ibex_org": "acme"}}, "no ibex_agent in the key or team metadata"),
    ({"key": {"ibex_org": "acme", "ibex_agent": ["a"]}}, "key metadata ibex_agent is not an agent id"),
    ({"key": "not a dict", "team": None}, "no ibex_org"),
])
def test_what_is_not_an_identity_is_unmapped(sources: dict[str, Any], reason: str) -> None:
    who = resolve_identity(_cfg(), sources)  # type: ignore[arg-type]
    assert isinstance(who, Unmapped) and reason in who.reason


REQ = ["request", "key", "team"]  # the README's agent_from


def test_request_metadata_picks_only_among_granted_orgs() -> None:
    cfg = _cfg(identity={"org_from": ["request", "key"], "agent_from": ["request"]})
    granted = {"ibex_orgs": ["acme"], "ibex_agents": ["bot"]}
    ok = resolve_identity(cfg, {"key": granted, "request": {"ibex_org": "acme", "ibex_agent": "bot"}})
    assert ok == Caller("acme", "bot")
    refused = resolve_identity(cfg, {"key": granted, "request": {"ibex_org": "globex", "ibex_agent": "bot"}})
    assert isinstance(refused, Denied) and "not in the key's or team's ibex_orgs" in refused.reason


@pytest.mark.parametrize(("request_meta", "reason"), [
    ({"ibex_agent": ["support-bot"]}, "request metadata ibex_agent is not an agent id"),
    ({"ibex_org": "globex"}, "org 'globex' from the request metadata is not in the key's or team's ibex_orgs"),
    ({"ibex_org": "initech"}, "org 'initech' has no client key"),  # granted, but the config has no key for it
    ({"ibex_org": "acme/x"}, "request metadata ibex_org is not an org id"),
])
async def test_what_the_request_sends_never_picks_pass_through(request_meta: dict[str, Any], reason: str) -> None:
    """A mapped caller who makes its own identity unmappable from the request would otherwise go
    through unassembled, without the directive, under ``unmapped: pass_through``: refused instead."""
    hook = _hook(unmapped="pass_through", identity={"org_from": ["request", "key"], "agent_from": REQ})
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot",
                                                "ibex_orgs": ["acme", "initech"]})
    data: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                            "metadata": request_meta}
    with pytest.raises(HTTPException) as exc:
        await hook.async_pre_call_hook(key, None, data, "acompletion")
    assert exc.value.status_code == 403 and reason in str(exc.value.detail)


@pytest.mark.parametrize(("orgs", "sources", "expected"), [
    # the request names an agent: only one some allow-list grants, or the key's or team's own
    ({}, {"key": {"ibex_org": "acme", "ibex_agent": "support-bot"}, "request": {"ibex_agent": "sales-assistant"}},
     "agent 'sales-assistant' from the request metadata is not granted"),
    ({}, {"key": {"ibex_org": "acme", "ibex_agent": "support-bot"}, "request": {"ibex_agent": "support-bot"}},
     Caller("acme", "support-bot")),
    ({}, {"key": {"ibex_org": "acme", "ibex_agents": ["support-*"]}, "request": {"ibex_agent": "support-eu"}},
     Caller("acme", "support-eu")),
    ({}, {"key": {"ibex_org": "acme", "ibex_agents": ["support-*"]}, "request": {"ibex_agent": "devops-helper"}},
     "agent 'devops-helper' is not in the key's ibex_agents"),
    ({"agents": ["support-bot", "sales-?"]}, {"key": {"ibex_org": "acme"}, "request": {"ibex_agent": "sales-1"}},
     Caller("acme", "sales-1")),
    # every list set must match, whatever the agent's source
    ({"agents": ["support-bot"]}, {"key": {"ibex_org": "acme", "ibex_agent": "devops-helper"}},
     "agent 'devops-helper' is not in orgs.acme.agents in the ibex-context hook config"),
    ({"agents": ["*"]}, {"key": {"ibex_org": "acme", "ibex_agents": ["a"]}, "team": {"ibex_agents": ["b"]},
                         "request": {"ibex_agent": "a"}}, "agent 'a' is not in the team's ibex_agents"),
    ({}, {"key": {"ibex_org": "acme", "ibex_agent": "a", "ibex_agents": "a"}},
     "key metadata ibex_agents is not a list of agent ids or patterns"),
    ({}, {"key": {"ibex_org": "acme", "ibex_agent": "Support-Bot", "ibex_agents": ["support-bot"]}},
     "agent 'Support-Bot' is not in the key's ibex_agents"),  # case-sensitive, as ids are
])
def test_the_agent_must_be_in_the_mappings_allow_lists(orgs: dict[str, Any], sources: dict[str, Any],
                                                        expected: Caller | str) -> None:
    cfg = _cfg(orgs={"acme": orgs}, identity={"agent_from": REQ})
    who = resolve_identity(cfg, sources)  # type: ignore[arg-type]
    if isinstance(expected, Caller):
        assert who == expected
    else:
        assert isinstance(who, Denied) and expected in who.reason, who


def test_on_degraded_comes_from_key_team_org_or_default_never_the_request() -> None:
    cfg = _cfg(orgs={"acme": {"on_degraded": "refuse"}, "globex": {}}, on_degraded="pass")
    key = {"ibex_org": "acme", "ibex_agent": "a"}
    assert resolve_identity(cfg, {"key": key}) == Caller("acme", "a", "refuse")
    assert resolve_identity(cfg, {"key": {**key, "ibex_org": "globex"}}) == Caller("globex", "a", "pass")
    got = resolve_identity(cfg, {"key": key, "team": {"ibex_on_degraded": "fallback_directive"},
                                 "request": {"ibex_on_degraded": "pass"}})
    assert got == Caller("acme", "a", "fallback_directive")
    assert resolve_identity(_cfg(), {"key": key}) == Caller("acme", "a", "fallback_directive")  # the default
    bad = resolve_identity(cfg, {"key": {**key, "ibex_on_degraded": "ignore"}})
    assert isinstance(bad, Denied) and "must be one of pass, refuse, fallback_directive" in bad.reason


async def test_a_denied_agent_is_refused_even_under_pass_through() -> None:
    hook = _hook(unmapped="pass_through", identity={"agent_from": REQ})
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot"})
    data: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                            "metadata": {"ibex_agent": "devops-helper"}}
    with pytest.raises(HTTPException) as exc:
        await hook.async_pre_call_hook(key, None, data, "acompletion")
    assert exc.value.status_code == 403 and "'devops-helper' from the request metadata is not granted" in str(
        exc.value.detail)


def test_directive_copies_are_bounded_and_age_out() -> None:
    copies = DirectiveCopies(parse_config({**BASE, "directive_copies": {"max_entries": 2, "max_chars": 10,
                                                                         "max_age_s": 0.05}}).directive_copies)
    copies.keep("acme", "a", "12345")
    copies.keep("acme", "b", "")
    copies.keep("acme", "c", "678")  # three entries: the oldest goes
    assert copies.get("acme", "a") is None and copies.get("acme", "b") is not None and len(copies) == 2
    copies.keep("acme", "d", "9" * 9)  # over max_chars with "678": that goes too
    assert copies.get("acme", "c") is None and copies.chars == 9
    copies.keep("acme", "e", "x" * 11)  # larger than every copy together: never kept
    assert copies.get("acme", "e") is None and copies.chars == 9
    got = copies.get("acme", "d")
    assert got is not None and got.text == "9" * 9 and got.source == "copy"
    time.sleep(0.06)
    assert copies.get("acme", "d") is None  # too old to be used


@pytest.mark.parametrize(("doc", "message"), [
    ({"orgs": {}}, "orgs: Dictionary should have at least 1 item"),
    ({"orgs": {"acme:x": {}}}, "org ids must match"),
    ({"orgs": {"acme": {}}, "unmapped": "allow"}, "unmapped: Input should be 'refuse' or 'pass_through'"),
    ({"orgs": {"acme": {"key": "k"}}}, "orgs.acme.key: Extra inputs are not permitted"),
    ({"orgs": {"acme": {}}, "identity": {"org_from": ["text"]}}, "identity.org_from.0"),
    ({"orgs": {"acme": {"agents": ["support bot"]}}}, "orgs.acme.agents.0: String should match pattern"),
    ({"orgs": {"acme": {"agents": []}}}, "orgs.acme.agents: List should have at least 1 item"),
    ({"orgs": {"acme": {}}, "on_degraded": "ignore"}, "on_degraded: Input should be 'pass', 'refuse' or"),
    ({"orgs": {"acme": {}}, "directive_copies": {"max_age_s": 0}}, "directive_copies.max_age_s: Input should be"),
])
def test_a_bad_config_is_one_line_naming_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(HookConfigError, match=message.replace(".", r"\.")) as exc:
        parse_config(doc)
    assert "\n" not in str(exc.value)


def test_config_files_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "h.yaml").write_text("orgs:\n  acme: {}\nunmapped: pass_through\nmodels: {fast: gpt-4o-mini}\n")
    assert load_config(tmp_path / "h.yaml").unmapped == "pass_through"
    (tmp_path / "h.json").write_text(json.dumps(BASE))
    assert set(load_config(tmp_path / "h.json").orgs) == {"acme", "globex"}
    with pytest.raises(HookConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_a_key_file_that_cannot_be_read_stops_the_hook_at_start(tmp_path: Path) -> None:
    cfg = _cfg(orgs={"acme": {"key_file": str(tmp_path / "nope.key")}}, broker_public_key="x" * 40)
    with pytest.raises(auth.AuthConfigError, match=r"nope\.key"):
        HookCore(cfg)


def _hook(**over: Any) -> IbexContextHook:
    return IbexContextHook(_cfg(**over))


async def test_an_unmapped_caller_passes_through_when_configured() -> None:
    hook = _hook(unmapped="pass_through")
    data: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "metadata": {}}
    out = await hook.async_pre_call_hook(UserAPIKeyAuth(api_key="sk-x"), None, data, "acompletion")
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    got = await hook.async_post_call_response_headers_hook(out, None, None)
    assert got == {"x-ibex-context": "passed_through",
                   "x-ibex-context-reason": "no org mapping for this caller: no ibex_org in the key or team metadata"}


async def test_an_unmapped_caller_is_refused_by_default() -> None:
    data: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(HTTPException) as exc:
        await _hook().async_pre_call_hook(UserAPIKeyAuth(api_key="sk-x", metadata={"ibex_org": "initech"}), None,
                                          data, "acompletion")
    assert exc.value.status_code == 403 and "org 'initech' has no client key" in str(exc.value.detail)


@pytest.mark.parametrize("call_type", ["aembedding", "atext_completion", "aimage_generation", "acreate_file",
                                       "pass_through_endpoint", "arerank"])
async def test_every_call_type_applies_the_identity_policy_first(call_type: str) -> None:
    """Not only chat: an unmapped caller is refused on any route; a mapped caller's call that is
    not assembled goes on as sent, saying so."""
    data: dict[str, Any] = {"model": "text-embedding-3-small", "input": ["x"]}
    with pytest.raises(HTTPException) as exc:
        await _hook().async_pre_call_hook(UserAPIKeyAuth(api_key="k"), None, data, call_type)
    assert exc.value.status_code == 403 and "no org mapping for this caller" in str(exc.value.detail)
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot"})
    out = await _hook().async_pre_call_hook(key, None, data, call_type)
    assert out["input"] == ["x"] and out["model"] == "text-embedding-3-small"
    assert await _hook().async_post_call_response_headers_hook(out, None, None) == {
        "x-ibex-context": "passed_through", "x-ibex-context-reason": f"{call_type} calls are not assembled"}


async def test_the_record_goes_where_litellm_keeps_its_own_metadata() -> None:
    """On /v1/messages and /v1/responses ``metadata`` is the provider's field (Anthropic's
    ``user_id``): the hook's record goes into ``litellm_metadata`` there, never to the provider."""
    key = UserAPIKeyAuth(api_key="k", metadata={"ibex_org": "acme", "ibex_agent": "support-bot"})
    data: dict[str, Any] = {"model": "m", "input": "x", "metadata": {"user_id": "u1"}, "litellm_metadata": {}}
    out = await _hook().async_pre_call_hook(key, None, data, "acreate_file")
    assert out["metadata"] == {"user_id": "u1"}
    assert out["litellm_metadata"]["ibex_context"]["status"] == "passed_through"


async def test_a_stream_reports_usage_only_when_the_provider_was_asked_for_it() -> None:
    """Without ``stream_options.include_usage`` LiteLLM fills a stream's usage with its own count:
    no calibration sample. ``usage_not_sent`` counts the calls that reached ``report_usage`` (the
    client is never started here, so nothing is sent either way)."""
    hook = _hook()
    core = hook.core
    assembly = degraded_response(AssembleRequest.model_validate({
        "request_id": "r", "org_id": "acme", "agent_id": "a", "model": "gpt-4o", "query": "q", "format": "openai",
        "messages": [{"role": "user", "content": "q"}], "deadline_ns": 1}), Unavailable("down"))
    usage = SimpleNamespace(usage=SimpleNamespace(prompt_tokens=12, prompt_tokens_details=None))
    client = core._clients["acme"]
    for call_id, kwargs, reported in [
        ("s1", {"stream": True}, 0),
        ("s2", {"stream": True, "stream_options": {"include_usage": True}}, 1),
        ("s3", {"stream": True, "optional_params": {"stream_options": {"include_usage": True}}}, 2),
        ("n1", {"stream": False}, 3),
    ]:
        key = core.remember(Caller("acme", "a"), assembly)  # LiteLLM hands the record back in litellm_params
        params = {"metadata": {"ibex_context": record(assembly, "degraded", [], key)}}
        await hook.async_log_success_event({**kwargs, "litellm_call_id": call_id, "litellm_params": params}, usage,
                                           None, None)
        assert core.forget(key) is None and client.stats["usage_not_sent"] == reported


def test_query_and_header_helpers() -> None:
    msgs = [{"role": "user", "content": "old"}, {"role": "user", "content": [
        {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": "u"}},
        {"type": "text", "text": "this?"}]}, {"role": "assistant", "content": "a"}]
    assert last_user_text(msgs, 100) == "what is this?" and last_user_text(msgs, 4) == "what"
    assert last_user_text([{"role": "system", "content": "s"}], 10) == ""
    assert header_value("a\nb\u00e9" + "x" * 600) == "a?b?" + "x" * 508
    assert headers({"status": "degraded", "reasons": ["context service UNAVAILABLE: down"], "memories": 0,
                    "request_id": "r1"}) == {
        "x-ibex-context": "degraded", "x-ibex-context-reason": "context service UNAVAILABLE: down",
        "x-ibex-context-request-id": "r1", "x-ibex-context-memories": "0"}
