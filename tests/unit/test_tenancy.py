"""Org tokens and key construction: nothing lets one tenant name another tenant's data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.shared.security.tenancy import bearer_token, mint_org_token, verify_org_token
from ibex_context.shared.stores.keys import (
    check_ident,
    directive_key,
    hot_key,
    memory_ids_key,
    memory_key,
    memory_key_prefix,
    org_key_patterns,
    org_prefix,
    vector_field,
)

SECRET = "s3cret-s3cret"
idents = st.from_regex(r"\A[A-Za-z0-9_.\-]{1,64}\Z")


def test_round_trip() -> None:
    tok = mint_org_token(SECRET, "acme")
    assert tok.startswith("ibex1.acme.")
    assert verify_org_token(SECRET, tok) == "acme"


def test_org_with_dots_round_trips() -> None:
    assert verify_org_token(SECRET, mint_org_token(SECRET, "acme.eu-1")) == "acme.eu-1"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t.replace("ibex1.acme.", "ibex1.globex."),  # re-label the org, keep the MAC
        lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # flip the MAC
        lambda t: t[:-2],  # truncated
        lambda t: t + "00",  # extended
        lambda t: t.upper(),
        lambda t: t.replace("ibex1.", "ibex2."),
        lambda t: "",
        lambda t: "ibex1.",
        lambda t: "ibex1..",
        lambda t: "ibex1.acme:x." + t.rsplit(".", 1)[1],  # separator smuggling
        lambda t: t[:-1] + "é",
        lambda t: t * 50,
    ],
)
def test_tampered_tokens_are_refused(mangle: object) -> None:
    tok = mint_org_token(SECRET, "acme")
    assert callable(mangle)
    assert verify_org_token(SECRET, mangle(tok)) is None


def test_other_secret_is_refused() -> None:
    assert verify_org_token("another-secret", mint_org_token(SECRET, "acme")) is None


def test_bad_org_cannot_be_minted() -> None:
    for bad in ["", "a:b", "a b", "x" * 65, "org/1", "acme\n"]:
        with pytest.raises(ValueError):
            mint_org_token(SECRET, bad)
    with pytest.raises(ValueError):
        mint_org_token("", "acme")


@given(org=idents, other=idents)
def test_tokens_bind_exactly_one_org(org: str, other: str) -> None:
    tok = mint_org_token(SECRET, org)
    assert verify_org_token(SECRET, tok) == org
    forged = f"ibex1.{other}.{tok.rsplit('.', 1)[1]}"
    assert verify_org_token(SECRET, forged) == (org if other == org else None)


def test_bearer_header_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_keys_have_the_documented_shape() -> None:
    assert directive_key("acme", "bot") == "{acme}:directive:bot"
    assert hot_key("acme", "bot") == "hot:{acme:bot}"
    assert memory_key("acme", "bot", "m-1") == "mem:{acme:bot}:m-1"
    assert memory_key_prefix("acme", "bot") == "mem:{acme:bot}:"
    assert memory_ids_key("acme", "bot") == "memids:{acme:bot}"
    assert vector_field("hash1-256") == "v_hash1_256"
    assert org_prefix("acme") == "{acme}:"
    assert org_key_patterns("acme") == ("{acme}:*", "mem:{acme:*", "memids:{acme:*", "hot:{acme:*")


@pytest.mark.parametrize("bad", ["", "a:b", "a b", "x" * 65, "*", "a\nb", "ü", "acme:hot_memories:x"])
@pytest.mark.parametrize("fn", [directive_key, hot_key, memory_ids_key, memory_key_prefix])
def test_keys_refuse_unsafe_ids(fn: object, bad: str) -> None:
    assert callable(fn)
    with pytest.raises(ValueError):
        fn(bad, "bot")
    with pytest.raises(ValueError):
        fn("acme", bad)


@given(org=idents, agent=idents)
def test_keys_stay_inside_their_org(org: str, agent: str) -> None:
    assert directive_key(org, agent).startswith(org_prefix(org))
    assert directive_key(org, agent).count(":") == 2  # a key never gains a separator from its parts
    for key in (hot_key(org, agent), memory_ids_key(org, agent), memory_key(org, agent, agent)):
        # The hash tag names exactly this org and agent: no part can close it or add a separator.
        tag = key[key.index("{") + 1 : key.index("}")]
        assert tag == f"{org}:{agent}" and key.count("{") == key.count("}") == 1
        assert key.count(":") == 2 + key.startswith("mem:{")
    assert check_ident(org) == org
