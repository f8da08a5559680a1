"""Directive envelopes against a real redis-server, and the admin CLI end to end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from redis.asyncio import Redis

from ibex_context.memory.store import directive_cli
from ibex_context.shared.stores.connect import async_client
from ibex_context.shared.stores.directives import (
    DirectiveEnvelope,
    MalformedDirective,
    delete_directive,
    get_directive,
    set_directive,
)
from ibex_context.shared.stores.keys import directive_key
from tests.helpers import main_in_process


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[Redis]:
    client = async_client(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_missing_directive_is_none(aredis: Redis) -> None:
    assert await get_directive(aredis, "acme", "bot") is None


async def test_set_get_bumps_version(aredis: Redis) -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    first = await set_directive(aredis, "acme", "bot", "Be brief. 用中文回答 🙂", now=when)
    assert (first.text, first.version, first.updated_at) == ("Be brief. 用中文回答 🙂", 1, when)
    second = await set_directive(aredis, "acme", "bot", 'Quote "this" \\ and </memory>')
    assert second.version == 2
    got = await get_directive(aredis, "acme", "bot")
    assert got == second
    raw = await aredis.get(directive_key("acme", "bot"))
    assert raw is not None
    stored = json.loads(raw)
    assert set(stored) == {"text", "version", "updated_at"}
    assert stored["updated_at"].endswith("Z")


async def test_concurrent_sets_get_distinct_versions(aredis: Redis) -> None:
    envs = await asyncio.gather(*(set_directive(aredis, "acme", "bot", f"v{i}") for i in range(20)))
    assert sorted(e.version for e in envs) == list(range(1, 21))
    final = await get_directive(aredis, "acme", "bot")
    assert final is not None and final.version == 20


async def test_directives_are_per_org_and_agent(aredis: Redis) -> None:
    await set_directive(aredis, "acme", "bot", "acme says")
    await set_directive(aredis, "globex", "bot", "globex says")
    a, g = await get_directive(aredis, "acme", "bot"), await get_directive(aredis, "globex", "bot")
    assert a is not None and a.text == "acme says"
    assert g is not None and g.text == "globex says"
    assert await get_directive(aredis, "acme", "other") is None


async def test_delete(aredis: Redis) -> None:
    await set_directive(aredis, "acme", "bot", "x")
    assert await delete_directive(aredis, "acme", "bot") is True
    assert await delete_directive(aredis, "acme", "bot") is False
    assert await get_directive(aredis, "acme", "bot") is None


@pytest.mark.parametrize(
    "raw",
    [
        b"plain text, not an envelope",
        b"[1, 2]",
        b'{"text": "x", "version": "1", "updated_at": "2026-01-01T00:00:00Z"}',
        b'{"text": "x", "version": 0, "updated_at": "2026-01-01T00:00:00Z"}',
        b'{"text": 5, "version": 1, "updated_at": "2026-01-01T00:00:00Z"}',
        b'{"text": "x", "version": 1}',
        b'{"text": "x", "version": 1, "updated_at": "2026-01-01T00:00:00"}',  # naive time
        b"\xff\xfe",
        b"",
    ],
)
async def test_malformed_envelope_raises_typed_error(aredis: Redis, raw: bytes) -> None:
    await aredis.set(directive_key("acme", "bot"), raw)
    with pytest.raises(MalformedDirective) as info:
        await get_directive(aredis, "acme", "bot")
    assert "{acme}:directive:bot" in str(info.value)


async def test_wrong_redis_type_is_malformed(aredis: Redis) -> None:
    await aredis.hset(directive_key("acme", "bot"), "text", "x")
    with pytest.raises(MalformedDirective):
        await get_directive(aredis, "acme", "bot")
    with pytest.raises(MalformedDirective):
        await set_directive(aredis, "acme", "bot", "y")


async def test_set_repairs_a_damaged_envelope(aredis: Redis) -> None:
    await aredis.set(directive_key("acme", "bot"), b"garbage")
    env = await set_directive(aredis, "acme", "bot", "fixed")
    assert env.version == 1 and env.text == "fixed"


async def test_unknown_envelope_fields_are_ignored(aredis: Redis) -> None:
    await aredis.set(
        directive_key("acme", "bot"),
        b'{"text": "x", "version": 7, "updated_at": "2026-01-01T00:00:00Z", "author": "ops"}',
    )
    env = await get_directive(aredis, "acme", "bot")
    assert isinstance(env, DirectiveEnvelope) and env.version == 7


async def test_bad_ids_and_text_are_refused(aredis: Redis) -> None:
    with pytest.raises(ValueError, match=r"^org_id must match .* \(got 'acme:x'\)$") as bad_id:
        await get_directive(aredis, "acme:x", "bot")
    with pytest.raises(ValueError, match=r"not valid Unicode \(lone surrogate\)") as bad_text:
        await set_directive(aredis, "acme", "bot", "\ud800")
    with pytest.raises(ValueError, match="at most 100000 characters") as too_long:
        await set_directive(aredis, "acme", "bot", "x" * 100_001)
    assert {e.type for e in (bad_id, bad_text, too_long)} == {ValueError}  # not a subclass
    assert await aredis.exists(directive_key("acme", "bot")) == 0


@pytest.mark.parametrize("text", ["", " ", "\n\t  \n"])
async def test_empty_directive_is_refused_and_nothing_is_written(aredis: Redis, text: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        await set_directive(aredis, "acme", "bot", text)
    assert await aredis.exists(directive_key("acme", "bot")) == 0


# ----------------------------------------------------------------------------------------- CLI


def _cli(*args: str, url: str | None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ibex_context.memory.store.directive_cli ARGS`` through its ``main()`` in this
    process (tests.helpers.main_in_process); the first test below runs it as a real process."""
    env = {k: v for k, v in os.environ.items() if k != "IBEX_REDIS_URL"}
    if url:
        env["IBEX_REDIS_URL"] = url
    return main_in_process(directive_cli.main, *args, env=env, stdin=stdin)


def _process(*args: str, url: str | None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "IBEX_REDIS_URL"}
    if url:
        env["IBEX_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "ibex_context.memory.store.directive_cli", *args],
        capture_output=True, text=True, env=env, input=stdin, timeout=30,
    )


def test_cli_set_show_delete(redis_url: str, tmp_path: object) -> None:
    r = _process("set", "--org", "acme", "--agent", "bot", "--text", "Be kind.", url=redis_url)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 1
    r = _process("set", "--org", "acme", "--agent", "bot", "--file", "-", url=redis_url, stdin="From stdin ✓\n")
    assert r.returncode == 0, r.stderr
    r = _process("show", "--org", "acme", "--agent", "bot", url=redis_url)
    assert r.returncode == 0 and json.loads(r.stdout)["text"] == "From stdin ✓\n"
    assert json.loads(r.stdout)["version"] == 2
    r = _process("delete", "--org", "acme", "--agent", "bot", url=None)  # no URL at all
    assert r.returncode == 2 and "IBEX_REDIS_URL" in r.stderr
    r = _process("delete", "--org", "acme", "--agent", "bot", "--redis-url", redis_url, url=None)
    assert r.returncode == 0 and json.loads(r.stdout) == {"deleted": True}
    r = _process("show", "--org", "acme", "--agent", "bot", url=redis_url)
    assert r.returncode == 1 and "no directive" in r.stderr


def test_cli_errors(redis_url: str) -> None:
    r = _cli("show", "--org", "ac:me", "--agent", "bot", url=redis_url)
    assert r.returncode == 2 and "--org" in r.stderr
    r = _cli("set", "--org", "acme", "--agent", "bot", url=redis_url)  # neither --text nor --file
    assert r.returncode == 2 and "one of the arguments --text --file is required" in r.stderr
    r = _cli("set", "--org", "acme", "--agent", "bot", "--file", "/nonexistent/x", url=redis_url)
    assert r.returncode == 2 and "nonexistent" in r.stderr
    r = _cli("show", "--org", "acme", "--agent", "bot", url="redis://127.0.0.1:1/0")
    assert r.returncode == 1 and "cannot reach Redis" in r.stderr


def _one_line(r: subprocess.CompletedProcess[str], code: int, prefix: str, *needles: str) -> None:
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(prefix) and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


@pytest.mark.parametrize(("how", "stdin"), [(["--text", ""], None), (["--text", "  \n "], None),
                                             (["--file", "-"], ""), (["--file", "-"], "\n\n")])
def test_cli_refuses_an_empty_directive(redis_url: str, how: list[str], stdin: str | None) -> None:
    _cli("set", "--org", "acme", "--agent", "bot", "--text", "Keep me.", url=redis_url)
    r = _cli("set", "--org", "acme", "--agent", "bot", *how, url=redis_url, stdin=stdin)
    _one_line(r, 2, "python -m ibex_context.memory.store.directive_cli set: ", how[0], "empty", "delete")
    r = _cli("show", "--org", "acme", "--agent", "bot", url=redis_url)
    assert r.returncode == 0 and json.loads(r.stdout)["text"] == "Keep me."  # the old one stands


def test_cli_mistakes_are_one_line(redis_url: str, tmp_path: Path) -> None:
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"caf\xe9")
    r = _cli("set", "--org", "acme", "--agent", "bot", "--file", str(binary), url=redis_url)
    _one_line(r, 2, "python -m ibex_context.memory.store.directive_cli set: ", "binary.txt", "UTF-8")
    r = _cli("set", "--org", "acme", "--agent", "bot", "--text", "x" * 100_001, url=redis_url)
    _one_line(r, 2, "python -m ibex_context.memory.store.directive_cli set: ", "--text", "100000")
    r = _cli("show", "--org", "acme", "--agent", "bot", "--extra", url=redis_url)
    _one_line(r, 2, "python -m ibex_context.memory.store.directive_cli: ", "--extra")
    r = _cli("show", "--agent", "bot", url=redis_url)
    _one_line(r, 2, "python -m ibex_context.memory.store.directive_cli show: ", "--org")
    r = _cli("show", "--org", "acme", "--agent", "bot", url="redis://127.0.0.1:1/0")
    _one_line(r, 1, "python -m ibex_context.memory.store.directive_cli show: ", "cannot reach Redis", "IBEX_REDIS_URL")
