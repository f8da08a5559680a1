"""Caller authentication with CURVE + ZAP on real sockets: orgs come from keys, never from payloads.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_auth.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ibex_context.shared.security import auth


def test_loopback_and_ipc_are_local() -> None:
    """The forms the guard accepts; every bypass form is in tests/stack/test_endpoint_guard.py."""
    for ok in ("tcp://127.0.0.1:5555", "ipc:///tmp/x", "tcp://[::1]:1"):
        assert auth.exposure(ok) is None
    assert auth.exposure("tcp://0.0.0.0:5555") and auth.exposure("tcp://10.1.2.3:5555")
    with pytest.raises(auth.AuthConfigError, match=r"10\.0\.0\.1 is not a loopback address"):
        auth.require_auth_or_loopback(["tcp://10.0.0.1:5555"], auth_on=False)
    auth.require_auth_or_loopback(["tcp://10.0.0.1:5555"], auth_on=True)


def test_bad_keys_files_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "k.json"
    bad.write_text('{"clients": [{"public_key": "short", "org_id": "acme"}]}')
    with pytest.raises(auth.AuthConfigError, match="z85"):
        auth.KeyRing.load(bad)
    bad.write_text('{"clients": [{"org_id": "acme"}]}')
    with pytest.raises(auth.AuthConfigError, match="public_key"):
        auth.KeyRing.load(bad)
    with pytest.raises(auth.AuthConfigError, match="cannot read"):
        auth.KeyRing.load(tmp_path / "absent.json")


def test_public_keys_starting_with_a_brace_load(tmp_path: Path) -> None:
    """z85 has '{' in its alphabet: a .pub file whose key starts with it is a key, not JSON (this
    made the key fixtures fail about once in thirty runs)."""
    kp = auth.generate_keypair()
    while not kp.public.startswith(b"{"):
        kp = auth.generate_keypair()
    (tmp_path / "k.pub").write_text(kp.public.decode() + "\n")
    assert auth.load_public_key(str(tmp_path / "k.pub")) == kp.public
    (tmp_path / "k.key").write_text(json.dumps({"public_key": kp.public.decode(), "secret_key": "x"}))
    assert auth.load_public_key(str(tmp_path / "k.key")) == kp.public
    (tmp_path / "bad.key").write_text('{"no_key": 1, "padding": "' + "x" * 40 + '"}')
    with pytest.raises(auth.AuthConfigError):
        auth.load_public_key(str(tmp_path / "bad.key"))


def _keys_doc(clients: list[dict[str, Any]], workers: list[dict[str, Any]]) -> str:
    return json.dumps({"clients": clients, "workers": workers})


def test_one_key_has_one_role(tmp_path: Path) -> None:
    """A client key also listed as a worker let a caller join the backend and read every org's
    requests: the keys file is refused, naming both entries."""
    acme, globex, w = (auth.generate_keypair().public.decode() for _ in range(3))
    kf = tmp_path / "keys.json"
    kf.write_text(_keys_doc([{"name": "acme-proxy", "public_key": acme, "org_id": "acme"}],
                            [{"name": "host-a", "public_key": w}, {"name": "sneaky", "public_key": acme}]))
    with pytest.raises(auth.AuthConfigError) as exc:
        auth.KeyRing.load(kf)
    assert str(exc.value) == (f"keys file {kf}: clients[0] ('acme-proxy') and workers[1] ('sneaky') are the same "
                              "public key; a key has one role (client or worker), give each its own keypair")
    kf.write_text(_keys_doc([{"name": "acme-proxy", "public_key": acme, "org_id": "acme"},
                             {"name": "acme-proxy", "public_key": acme, "org_id": "globex"}], []))
    with pytest.raises(auth.AuthConfigError, match=r"clients\[0\] \('acme-proxy'\) and clients\[1\] \('acme-proxy'\) "
                       "list the same public key with different grants"):
        auth.KeyRing.load(kf)
    kf.write_text(_keys_doc([{"name": "a", "public_key": acme, "org_id": "acme", "agents": ["x", "y"]},
                             {"name": "a", "public_key": acme, "org_id": "acme", "agents": ["y", "x"]},
                             {"name": "g", "public_key": globex, "org_id": "globex"}],
                            [{"name": "host-a", "public_key": w}, {"name": "host-a2", "public_key": w}]))
    ring = auth.KeyRing.load(kf)  # the same grant twice, or a worker twice, is harmless
    assert set(ring.clients) == {acme.encode(), globex.encode()} and ring.workers == {w.encode()}
    with pytest.raises(auth.AuthConfigError, match="one role"):
        auth.KeyRing({acme.encode(): auth.ClientGrant("a", "acme", frozenset("*"))}, {acme.encode()})


@pytest.mark.parametrize(("doc", "message"), [
    ('{"clients": 5}', "clients must be a list"),
    ('{"workers": "abc"}', "workers must be a list"),
    ('{"clients": ["x"]}', "clients[0]: expected an object with public_key"),
    ('{"workers": [{"public_key": 7}]}', "workers[0]: public_key is missing or not a string"),
    ('[]', "expected an object with clients and workers"),
])
def test_malformed_keys_files_name_the_entry(tmp_path: Path, doc: str, message: str) -> None:
    kf = tmp_path / "keys.json"
    kf.write_text(doc)
    with pytest.raises(auth.AuthConfigError) as exc:
        auth.KeyRing.load(kf)
    assert message in str(exc.value)


def test_client_grants_are_checked(tmp_path: Path) -> None:
    key = auth.generate_keypair().public.decode()
    kf = tmp_path / "keys.json"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"org_id": None}, "org_id must be an org id"), ({"org_id": "a b"}, "org_id must be"),
        ({"org_id": "acme", "agents": []}, "agents must be a non-empty list"),
        ({"org_id": "acme", "agents": ["../x"]}, "agents must be"), ({"org_id": "acme", "name": 3}, "name must be")]
    for entry, message in cases:
        kf.write_text(_keys_doc([{"public_key": key, **entry}], []))
        with pytest.raises(auth.AuthConfigError, match=message):
            auth.KeyRing.load(kf)
