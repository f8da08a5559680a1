"""``ibex-context keys``: every mistake is one line and exit 2, nothing is written outside --dir,
and a key keeps one role (docs/security.md "Authentication").

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_keys_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ibex_context.ops import cli
from ibex_context.shared.security import auth


def _keys(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["keys", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str, phrase: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ibex-context keys: ") and phrase in lines[0], err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "..", "x" * 65, "a b", "ключ", "a\nb"])
def test_generate_refuses_names_that_are_not_key_names(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       name: str) -> None:
    code, out, err = _keys(capsys, "generate", "--dir", str(tmp_path / "keys"), "--name", name)
    assert code == 2 and out == ""
    _one_line_error(err, f"--name {name!r} is not a key name")
    assert list(tmp_path.rglob("*")) == []  # not even --dir was created


def test_generate_refuses_bad_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    for directory, phrase in [(a_file, f"--dir {a_file} is not a directory"),
                              (a_file / "sub", f"cannot create key directory {a_file / 'sub'}: Not a directory"),
                              (Path("/proc/ibex-keys-test"), "cannot create key directory /proc/ibex-keys-test")]:
        code, out, err = _keys(capsys, "generate", "--dir", str(directory), "--name", "proxy")
        assert code == 2 and out == ""
        _one_line_error(err, phrase)
    assert _tree(tmp_path) == {"file": b"keep me"}


def test_generate_writes_a_pair_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _keys(capsys, "generate", "--dir", str(tmp_path), "--name", "proxy-1")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'proxy-1.key'} (secret, mode 0600)")
    assert sorted(_tree(tmp_path)) == ["proxy-1.key", "proxy-1.pub"]
    assert (tmp_path / "proxy-1.key").stat().st_mode & 0o777 == 0o600
    kp = auth.load_keypair(tmp_path / "proxy-1.key")
    assert auth.load_public_key(str(tmp_path / "proxy-1.pub")) == kp.public
    before = _tree(tmp_path)
    code, _, err = _keys(capsys, "generate", "--dir", str(tmp_path), "--name", "proxy-1")
    assert code == 2
    _one_line_error(err, "already exists; refusing to overwrite a key")
    (tmp_path / "proxy-1.key").unlink()  # a lone .pub is not replaced either
    code, _, err = _keys(capsys, "generate", "--dir", str(tmp_path), "--name", "proxy-1")
    assert code == 2
    _one_line_error(err, f"{tmp_path / 'proxy-1.pub'} already exists")
    assert _tree(tmp_path) == {"proxy-1.pub": before["proxy-1.pub"]}


@pytest.fixture
def pubs(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "keys"
    return {name: auth.write_keypair(d, name)[1] for name in ("acme-proxy", "host-a")}


def _register(capsys: pytest.CaptureFixture[str], kf: Path, pub: Path, *args: str) -> tuple[int, str, str]:
    return _keys(capsys, "register", "--keys-file", str(kf), "--public", str(pub), *args)


def test_register_refuses_a_registered_key_unless_replace(tmp_path: Path, pubs: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    kf = tmp_path / "keys.json"
    client = ["--role", "client", "--name", "acme-proxy", "--org", "acme", "--agents", "support-bot"]
    code, out, _ = _register(capsys, kf, pubs["acme-proxy"], *client)
    assert code == 0 and out == f"registered client acme-proxy in {kf}\n"
    first = kf.read_bytes()
    code, out, err = _register(capsys, kf, pubs["acme-proxy"], *client)
    assert code == 2 and out == ""
    _one_line_error(err, "already registered as client 'acme-proxy'; pass --replace to change its entry")
    assert kf.read_bytes() == first

    code, out, _ = _register(capsys, kf, pubs["acme-proxy"], "--role", "client", "--name", "acme-proxy-2",
                             "--org", "acme", "--agents", "support-bot,sales", "--replace")
    assert code == 0 and out == f"replaced client acme-proxy-2 in {kf}\n"
    doc = json.loads(kf.read_text())
    key = pubs["acme-proxy"].read_text().strip()
    assert doc == {"clients": [{"name": "acme-proxy-2", "public_key": key, "org_id": "acme",
                                "agents": ["support-bot", "sales"]}], "workers": []}
    ring = auth.KeyRing.load(kf)
    assert ring.clients[key.encode()].agents == {"support-bot", "sales"}


@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_a_key_never_gets_the_other_role(tmp_path: Path, pubs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                         replace: list[str]) -> None:
    kf = tmp_path / "keys.json"
    client = ["--role", "client", "--name", "acme-proxy", "--org", "acme"]
    assert _register(capsys, kf, pubs["acme-proxy"], *client)[0] == 0
    assert _register(capsys, kf, pubs["host-a"], "--role", "worker", "--name", "host-a")[0] == 0
    before = kf.read_bytes()
    code, _, err = _register(capsys, kf, pubs["acme-proxy"], "--role", "worker", "--name", "sneaky", *replace)
    assert code == 2
    _one_line_error(err, "already registered as client 'acme-proxy'; a key has one role, generate another "
                         "keypair for the worker")
    code, _, err = _register(capsys, kf, pubs["host-a"], "--role", "client", "--name", "x", "--org", "acme", *replace)
    assert code == 2
    _one_line_error(err, "already registered as worker 'host-a'; a key has one role")
    assert kf.read_bytes() == before


@pytest.mark.parametrize(("content", "phrase"), [
    ("{bad", "cannot read keys file"),
    ('{"clients": 5}', "clients must be a list"),
    ("[]", "expected an object with clients and workers"),
    ('{"clients": [{"org_id": "acme"}]}', "clients[0]: public_key is missing or not a string"),
    (b"\xff\xfe".decode("latin-1"), "cannot read keys file"),
])
def test_register_with_a_malformed_keys_file(tmp_path: Path, pubs: dict[str, Path],
                                             capsys: pytest.CaptureFixture[str], content: str, phrase: str) -> None:
    kf = tmp_path / "keys.json"
    kf.write_text(content, encoding="latin-1")
    before = kf.read_bytes()
    code, out, err = _register(capsys, kf, pubs["host-a"], "--role", "worker", "--name", "host-a")
    assert code == 2 and out == ""
    _one_line_error(err, phrase)
    assert kf.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["keys", "keys.json"]


def test_register_refuses_to_edit_a_keys_file_with_a_key_in_two_roles(
        tmp_path: Path, pubs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    key = pubs["acme-proxy"].read_text().strip()
    kf = tmp_path / "keys.json"
    kf.write_text(json.dumps({"clients": [{"name": "acme-proxy", "public_key": key, "org_id": "acme"}],
                              "workers": [{"name": "sneaky", "public_key": key}]}))
    code, _, err = _register(capsys, kf, pubs["host-a"], "--role", "worker", "--name", "host-a")
    assert code == 2
    _one_line_error(err, "clients[0] ('acme-proxy') and workers[0] ('sneaky') are the same public key")


def test_register_with_a_missing_or_unusable_keys_file(tmp_path: Path, pubs: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    worker = ["--role", "worker", "--name", "host-a"]
    absent = tmp_path / "absent" / "keys.json"
    for kf, phrase in [(absent, f"cannot write keys file {absent}: No such file or directory"),
                       (tmp_path / "keys", f"cannot read keys file {tmp_path / 'keys'}")]:
        code, _, err = _register(capsys, kf, pubs["host-a"], *worker)
        assert code == 2
        _one_line_error(err, phrase)
    assert not (tmp_path / "absent").exists()
    code, _, err = _register(capsys, tmp_path / "k.json", tmp_path / "missing.pub", *worker)
    assert code == 2
    _one_line_error(err, f"cannot read public key {tmp_path / 'missing.pub'}")
    assert not (tmp_path / "k.json").exists()
    code, _, _ = _register(capsys, tmp_path / "k.json", pubs["host-a"], *worker)  # absent file, existing dir: created
    assert code == 0 and [w["name"] for w in json.loads((tmp_path / "k.json").read_text())["workers"]] == ["host-a"]


@pytest.mark.parametrize(("args", "phrase"), [
    (["--org", "acme corp"], "--org 'acme corp' is not an org id"),
    (["--org", "acme", "--agents", "bot,../x"], "--agents '../x' is not an agent id"),
    ([], "a client key needs --org"),
    (["--org", "acme", "--name", "a/b"], "--name 'a/b' is not a key name"),
])
def test_register_names_the_bad_option(tmp_path: Path, pubs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                       args: list[str], phrase: str) -> None:
    kf = tmp_path / "keys.json"
    base = ["--role", "client"] + ([] if "--name" in args else ["--name", "acme-proxy"])
    code, _, err = _register(capsys, kf, pubs["acme-proxy"], *base, *args)
    assert code == 2
    _one_line_error(err, phrase)
    assert not kf.exists()
